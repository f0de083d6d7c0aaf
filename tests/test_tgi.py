"""TGI's own API (`/generate`, `/generate_stream`, `POST /`, `/info`; gateway/tgi.py) through the
shared fleet, with Hugging Face's own client (`InferenceClient.text_generation`): texts against
the in-process engine's greedy tokens, details and streamed tokens, stop sequences, sampling by
TGI's rule, and TGI's error bodies."""

from __future__ import annotations

import json

import httpx
import pytest

PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def client(fleet):
    from huggingface_hub import InferenceClient

    return InferenceClient(base_url=fleet["url"])


def test_generated_text_is_the_greedy_continuation(client, oracle, tokenizer):
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    expected = oracle(ids, 12)
    text = tokenizer.decode(expected, skip_special_tokens=True)
    assert client.text_generation(PROMPT, max_new_tokens=12) == text
    assert client.text_generation(PROMPT, max_new_tokens=12, return_full_text=True) == \
        PROMPT + text

    out = client.text_generation(PROMPT, max_new_tokens=12, details=True, top_n_tokens=2,
                                 decoder_input_details=True)
    d = out.details
    assert out.generated_text == text and d.generated_tokens == len(expected)
    assert d.finish_reason == "length" and d.seed is None  # greedy: no seed
    assert [t.id for t in d.tokens] == expected
    assert all(t.logprob is not None and t.logprob <= 0 for t in d.tokens)
    assert all(not t.special for t in d.tokens)
    # Greedy: each step's most likely token is the one taken. (The client leaves the tokens of
    # nested lists as dicts.)
    assert [top[0]["id"] for top in d.top_tokens] == expected
    assert all(len(top) == 2 for top in d.top_tokens)
    assert [t.id for t in d.prefill] == ids and d.prefill[0].logprob is None
    assert all(t.logprob is not None and t.logprob <= 0 for t in d.prefill[1:])


def test_a_stream_sends_each_token_and_ends_with_the_text(client, oracle, tokenizer):
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    expected = oracle(ids, 10)
    events = list(client.text_generation(PROMPT, max_new_tokens=10, stream=True, details=True))
    assert [e.token.id for e in events] == expected
    assert [e.index for e in events] == list(range(1, len(expected) + 1))
    text = tokenizer.decode(expected, skip_special_tokens=True)
    assert "".join(e.token.text for e in events) == text
    assert all(e.generated_text is None and e.details is None for e in events[:-1])
    assert events[-1].generated_text == text
    assert events[-1].details.finish_reason == "length"
    assert events[-1].details.generated_tokens == len(expected)
    # Without details, the tokens alone.
    pieces = list(client.text_generation(PROMPT, max_new_tokens=10, stream=True))
    assert "".join(pieces) == text


def test_stop_sequences_end_the_text_and_stay_in_it(client, oracle, tokenizer):
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    full = tokenizer.decode(oracle(ids, 12), skip_special_tokens=True)
    stop = full.split()[2]  # a word inside the greedy text
    out = client.text_generation(PROMPT, max_new_tokens=12, stop=[stop], details=True)
    assert out.generated_text == full[:full.index(stop) + len(stop)]
    assert out.details.finish_reason == "stop_sequence"
    # An end-of-sequence token: a chat prompt the model answers in a few words.
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}],
                                         add_generation_prompt=True, tokenize=False)
    out = client.text_generation(chat, max_new_tokens=64, details=True)
    assert out.details.finish_reason == "eos_token"
    assert out.details.generated_tokens < 64


def test_sampling_follows_tgis_rule_and_reports_its_seed(client, fleet):
    greedy = client.text_generation(PROMPT, max_new_tokens=16)
    out = client.text_generation(PROMPT, max_new_tokens=16, do_sample=True, seed=7,
                                 details=True)
    again = client.text_generation(PROMPT, max_new_tokens=16, do_sample=True, seed=7)
    assert out.details.seed == 7 and again == out.generated_text
    # A warper alone (temperature) samples; without a seed one is drawn and reported.
    drawn = [client.text_generation(PROMPT, max_new_tokens=16, temperature=1.5, details=True)
             for _ in range(3)]
    assert all(d.details.seed is not None for d in drawn)
    assert len({d.details.seed for d in drawn}) == 3
    assert any(d.generated_text != greedy for d in drawn)
    redo = httpx.post(fleet["url"] + "/generate", timeout=60, json={
        "inputs": PROMPT, "parameters": {"max_new_tokens": 16, "temperature": 1.5,
                                         "seed": drawn[0].details.seed}})
    assert redo.json()["generated_text"] == drawn[0].generated_text


def test_the_compat_route_and_info(fleet, tokenizer, oracle):
    expected = oracle(tokenizer.encode(PROMPT, add_special_tokens=False), 6)
    text = tokenizer.decode(expected, skip_special_tokens=True)
    r = httpx.post(fleet["url"] + "/", json={"inputs": PROMPT,
                                             "parameters": {"max_new_tokens": 6}}, timeout=60)
    assert r.status_code == 200 and r.json() == [{"generated_text": text}]
    with httpx.stream("POST", fleet["url"] + "/", timeout=60, json={
            "inputs": PROMPT, "parameters": {"max_new_tokens": 6}, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    events = [json.loads(line.removeprefix("data:")) for line in lines]
    assert all(line.startswith("data:") for line in lines)
    assert [e["token"]["id"] for e in events] == expected
    assert events[-1]["generated_text"] == text
    info = httpx.get(fleet["url"] + "/info", timeout=30).json()
    assert info["model_id"] == "SmolLM2-135M-Instruct" and info["max_total_tokens"] == 8192
    # The page still answers GET /, and a 405 names both methods of the path (the page's route
    # comes from an included router), as it does on an included router's own paths.
    assert "text/html" in httpx.get(fleet["url"] + "/", timeout=30).headers["content-type"]
    r = httpx.put(fleet["url"] + "/", timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "GET, POST"
    assert r.json()["error_type"] == "method_not_allowed"
    r = httpx.put(fleet["url"] + "/v1/files/file-x", timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET"


@pytest.mark.parametrize(("body", "param"), [
    ({"inputs": ""}, "inputs"),
    ({"inputs": "x", "parameters": {"temperature": 0}}, "parameters.temperature"),
    ({"inputs": "x", "parameters": {"top_p": 1.0}}, "parameters.top_p"),
    ({"inputs": "x", "parameters": {"best_of": 2}}, "parameters.best_of"),
    ({"inputs": "x", "parameters": {"watermark": True}}, "parameters.watermark"),
    ({"inputs": "x", "parameters": {"max_new_tokens": 0}}, "parameters.max_new_tokens"),
    ({"inputs": "hello " * 9000, "parameters": {"max_new_tokens": 4}}, "inputs"),
])
def test_bad_requests_get_tgis_422(fleet, body, param):
    r = httpx.post(fleet["url"] + "/generate", json=body, timeout=30)
    assert r.status_code == 422, r.text
    err = r.json()
    assert set(err) == {"error", "error_type"} and err["error_type"] == "validation"
    assert param in err["error"]


def test_streaming_refuses_decoder_input_details(fleet):
    r = httpx.post(fleet["url"] + "/generate_stream", timeout=30, json={
        "inputs": PROMPT, "parameters": {"decoder_input_details": True}})
    assert r.status_code == 422 and "decoder_input_details" in r.json()["error"]
