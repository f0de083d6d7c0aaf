"""The fleet end to end: a real redis-server, real scheduler / worker / gateway processes, the real
model (float32 so the in-process engine is an exact oracle), the official `openai` client."""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import subprocess
import time

import httpx
import pytest

from shoal.fleet import free_port, shoal_command
from tests.conftest import spawn_worker


def _shoal(*args, **kw):
    return subprocess.Popen([*shoal_command(), *args], **kw)


def _chat_ids(tokenizer, text):
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                              add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


def test_openai_client_chat_and_completions(fleet, oracle, tokenizer):
    from openai import OpenAI

    client = OpenAI(base_url=fleet["url"] + "/v1", api_key="none")
    question = "What is the capital of France?"
    expected_ids = oracle(_chat_ids(tokenizer, question), 24)
    expected = tokenizer.decode(expected_ids, skip_special_tokens=True)

    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=24, temperature=0,
                                       messages=[{"role": "user", "content": question}])
    assert r.choices[0].message.content == expected
    assert r.usage.prompt_tokens == len(_chat_ids(tokenizer, question))
    assert r.usage.completion_tokens == len(expected_ids)

    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=24,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": question}])
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert chunks[-1].usage.completion_tokens == len(expected_ids)

    prompt = "Once upon a time"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    exp = tokenizer.decode(oracle(ids, 16), skip_special_tokens=True)
    c = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=16, temperature=0)
    assert c.choices[0].text == exp and c.usage.prompt_tokens == len(ids)
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=16, temperature=0, stream=True))
    assert streamed == exp
    by_ids = client.completions.create(model="SmolLM2-135M-Instruct", prompt=ids, max_tokens=16, temperature=0)
    assert by_ids.choices[0].text == exp


def test_chat_content_as_text_parts(fleet, oracle, tokenizer):
    """OpenAI's array form of a message's content: its text parts joined by newlines, as vLLM
    does; other kinds of part are refused by name."""
    expected = tokenizer.decode(oracle(_chat_ids(tokenizer, "Name a color.\nOne word."), 12),
                                skip_special_tokens=True)
    parts = [{"type": "text", "text": "Name a color."}, {"type": "text", "text": "One word."}]
    r = httpx.post(fleet["url"] + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": parts}], "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == expected
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    for content, param, words in [([image], "messages.0.content.0.type", "not supported"),
                                  (5, "messages.0.content", "a list of text parts")]:
        r = httpx.post(fleet["url"] + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": content}], "max_tokens": 4})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param and words in err["message"], err


def test_websocket_receives_the_same_tokens(fleet, oracle, tokenizer):
    import websockets.sync.client as wsc

    ids = tokenizer.encode("The ocean is", add_special_tokens=False)
    expected = oracle(ids, 10)
    with wsc.connect(fleet["url"].replace("http", "ws") + "/v1/stream") as ws:
        ws.send(json.dumps({"prompt": "The ocean is", "max_tokens": 10, "temperature": 0}))
        msgs = []
        while True:
            m = json.loads(ws.recv())
            msgs.append(m)
            if m["type"] in ("done", "error"):
                break
    tokens = [m["token_id"] for m in msgs if m["type"] == "token"]
    assert tokens == expected
    assert [m["index"] for m in msgs if m["type"] == "token"] == list(range(len(expected)))
    assert msgs[-1]["usage"]["completion_tokens"] == len(expected)
    assert "".join(m["text"] for m in msgs if m["type"] == "token") == tokenizer.decode(expected, skip_special_tokens=True)
    with wsc.connect(fleet["url"].replace("http", "ws") + "/v1/stream") as ws:
        ws.send(json.dumps({"prompt": "The ocean is", "n": 2}))
        m = json.loads(ws.recv())
    assert m["type"] == "error" and "one choice" in m["message"]  # one stream, one choice
    with wsc.connect(fleet["url"].replace("http", "ws") + "/v1/stream") as ws:
        ws.send(json.dumps({"messages": [{"role": "user", "content": [{"type": "text"}]}]}))
        m = json.loads(ws.recv())
    assert m == {"type": "error", "message": "messages.0.content.0.text: Field required"}


def test_concurrent_streaming_clients(fleet, oracle, tokenizer):
    prompts = [f"Write a short line about the number {i}." for i in range(32)]

    async def one(client, p):
        text = ""
        async with client.stream("POST", fleet["url"] + "/v1/completions",
                                 json={"prompt": p, "max_tokens": 8, "temperature": 0, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    texts = asyncio.run(main())
    for p, t in zip(prompts, texts):
        ids = tokenizer.encode(p, add_special_tokens=False)
        assert t == tokenizer.decode(oracle(ids, 8), skip_special_tokens=True), p


def test_bad_requests_get_openai_errors(fleet):
    cases = [
        ("/v1/completions", {"prompt": "x", "n": 17}, "n"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": [99999999]}, "prompt"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "cache_salt": ""}, "cache_salt"),
    ]
    for path, body, param in cases:
        r = httpx.post(fleet["url"] + path, json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and param in (err["param"] or ""), err
    r = httpx.post(fleet["url"] + "/v1/completions", json={"prompt": "x", "model": "gpt-9"}, timeout=30)
    assert r.status_code == 404 and "gpt-9" in r.json()["error"]["message"]


def test_a_bad_prompt_is_judged_by_its_own_form(fleet):
    """`prompt` takes four forms; the error speaks of the one sent, at its own place in it."""
    cases = [
        ({"prompt": ""}, "prompt", "at least 1 character"),
        ({"prompt": []}, "prompt", "at least 1 item"),
        ({"prompt": [5, -1]}, "prompt.1", "greater than or equal to 0"),
        ({"prompt": ["a", 3]}, "prompt.1", "valid string"),
        ({"prompt": [[1], []]}, "prompt.1", "at least 1 item"),
        ({"prompt": 5}, "prompt", "a list of token ids"),
    ]
    for body, param, words in cases:
        r = httpx.post(fleet["url"] + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], (body, err)
        assert err["message"].startswith(param + ": "), err
    r = httpx.post(fleet["url"] + "/v1/completions", content=b'{"prompt": "x",}', timeout=30,
                   headers={"content-type": "application/json"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] is None, err
    assert err["message"].startswith("the request body is not valid JSON") and "15" in err["message"]


def _top_steps(hf_model, tokenizer, ids: list[int], steps: int, k: int) -> list[dict[str, float]]:
    """transformers' greedy continuation of `ids`: at each step the k most likely tokens' texts
    and logprobs, the greedy one first."""
    import torch

    seq, out = list(ids), []
    with torch.no_grad():
        for _ in range(steps):
            lp = torch.log_softmax(hf_model(torch.tensor([seq])).logits[0, -1].double(), -1)
            values, top = lp.topk(k)
            out.append({tokenizer.decode([t]): v for t, v in zip(top.tolist(), values.tolist())})
            seq.append(int(top[0]))
    return out


def _sse(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    return [json.loads(x) for x in lines if x != "[DONE]"]


def test_top_logprobs_match_the_oracle_streamed_or_not(fleet, hf_model, tokenizer):
    """`logprobs: k` (completions) and `logprobs` + `top_logprobs: k` (chat): each token's logprob
    and its step's k most likely tokens, as transformers computes them, in OpenAI's two forms."""
    prompt = "The capital of France is"
    steps = _top_steps(hf_model, tokenizer, tokenizer.encode(prompt, add_special_tokens=False), 6, 3)
    url = fleet["url"] + "/v1/completions"
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 3}
    whole = httpx.post(url, json=body, timeout=60).json()["choices"][0]["logprobs"]
    chunks = [c["choices"][0]["logprobs"] for c in _sse(url, body) if c["choices"]]
    streamed = {key: [x for c in chunks if c for x in c[key]] for key in whole if key != "text_offset"}
    offsets = [0, *itertools.accumulate(len(t) for t in whole["tokens"][:-1])]
    assert whole["text_offset"] == offsets and [x for c in chunks for x in c["text_offset"]] == offsets
    for got in (whole, streamed):
        assert got["tokens"] == [next(iter(s)) for s in steps]
        assert got["token_logprobs"] == pytest.approx([next(iter(s.values())) for s in steps], abs=1e-3)
        for top, expected in zip(got["top_logprobs"], steps, strict=True):
            assert top.keys() == expected.keys() and top == pytest.approx(expected, abs=1e-3)

    question = "Name a fruit."
    steps = _top_steps(hf_model, tokenizer, _chat_ids(tokenizer, question), 5, 2)
    url = fleet["url"] + "/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 2}
    whole = httpx.post(url, json=body, timeout=60).json()["choices"][0]["logprobs"]["content"]
    streamed = [e for c in _sse(url, body) if c["choices"] and c["choices"][0].get("logprobs")
                for e in c["choices"][0]["logprobs"]["content"]]
    for got in (whole, streamed):
        assert len(got) == len(steps)
        for entry, expected in zip(got, steps):
            assert entry["token"] == next(iter(expected)) and bytes(entry["bytes"]).decode() == entry["token"]
            assert {a["token"]: a["logprob"] for a in entry["top_logprobs"]} == \
                pytest.approx(expected, abs=1e-3)
            assert entry["logprob"] == entry["top_logprobs"][0]["logprob"]

    for path, bad, param in [("/v1/chat/completions", {"messages": body["messages"], "top_logprobs": 2},
                              "top_logprobs"),
                             ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs")]:
        r = httpx.post(fleet["url"] + path, json=bad, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_echo_scores_the_prompt_as_evaluation_harnesses_ask(fleet, hf_model, tokenizer):
    """`echo` with `logprobs` (lm-evaluation-harness's loglikelihood request: echo, logprobs 1,
    max_tokens 1): the prompt's tokens and their logprobs as transformers computes them, then the
    completion's; the first prompt token has none."""
    import torch

    prompt = "The capital of France is Paris, and the capital of Italy is Rome."
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    with torch.no_grad():
        oracle = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), -1)
    url = fleet["url"] + "/v1/completions"
    body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    choice = httpx.post(url, json=body, timeout=60).json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(prompt) and len(lp["tokens"]) == len(ids) + 1
    assert lp["tokens"][: len(ids)] == [tokenizer.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"][0] == 0 and lp["text_offset"][len(ids)] == len(prompt)  # ASCII
    expected = oracle[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    assert lp["token_logprobs"][1: len(ids)] == pytest.approx(expected, abs=1e-3)
    for p in range(1, len(ids)):  # the most likely token at each prompt position
        (text, value), = lp["top_logprobs"][p].items()
        assert value == pytest.approx(float(oracle[p - 1].max()), abs=1e-3)
    plain = httpx.post(url, json={"prompt": prompt, "max_tokens": 4, "temperature": 0,
                                  "echo": True}, timeout=60).json()["choices"][0]
    alone = httpx.post(url, json={"prompt": prompt, "max_tokens": 4, "temperature": 0},
                       timeout=60).json()["choices"][0]
    assert plain["text"] == prompt + alone["text"] and plain["logprobs"] is None
    # Streamed, as vLLM streams echo: the prompt opens each choice; the choices' texts and
    # logprobs, joined, are the unstreamed ones.
    for asked in (body, {**body, "max_tokens": 5, "logprobs": 2, "n": 2},
                  {"prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True}):
        whole = httpx.post(url, json=asked, timeout=60).json()["choices"]
        chunks = [c["choices"][0] for c in _sse(url, asked) if c["choices"]]
        for i, want in enumerate(whole):
            mine = [c for c in chunks if c["index"] == i]
            assert mine[0]["text"].startswith(prompt)
            assert "".join(c["text"] for c in mine) == want["text"]
            if want["logprobs"] is None:
                assert all(c["logprobs"] is None for c in mine)
                continue
            got = {key: [x for c in mine for x in c["logprobs"][key]] for key in want["logprobs"]}
            assert got["tokens"] == want["logprobs"]["tokens"]
            assert got["text_offset"] == want["logprobs"]["text_offset"]
            assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
            assert got["token_logprobs"][1:] == pytest.approx(want["logprobs"]["token_logprobs"][1:],
                                                              abs=1e-4)
            for a, b in zip(got["top_logprobs"][1:], want["logprobs"]["top_logprobs"][1:]):
                assert a.keys() == b.keys() and a == pytest.approx(b, abs=1e-4)


def test_prompt_logprobs_as_vllm_gives_them(fleet, hf_model, tokenizer):
    """vLLM's `prompt_logprobs: k`: None for the first prompt token, then per token a map from
    token id to logprob, rank and text holding the prompt token and its position's k most
    likely tokens, as transformers computes them; on completions per choice (beside echo's own
    k), on chat once for the request; refused with stream."""
    import torch

    def check(entries, ids, k):
        with torch.no_grad():
            oracle = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), -1)
        assert entries[0] is None and len(entries) == len(ids)
        for p in range(1, len(ids)):
            row = oracle[p - 1]
            entry = {int(t): v for t, v in entries[p].items()}
            rank = int((row > row[ids[p]]).sum()) + 1
            assert entry[ids[p]]["rank"] == rank  # (ties within float32 rounding aside)
            assert entry[ids[p]]["logprob"] == pytest.approx(float(row[ids[p]]), abs=1e-3)
            assert entry[ids[p]]["decoded_token"] == tokenizer.decode([ids[p]])
            values, top = row.topk(k)
            for j, (t, v) in enumerate(zip(top.tolist(), values.tolist())):
                assert entry[t]["logprob"] == pytest.approx(v, abs=1e-3)
                assert t == ids[p] or entry[t]["rank"] == j + 1
            assert len(entry) in (k, k + 1)

    prompt = "The capital of France is Paris, and the capital of Italy is Rome."
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    url = fleet["url"]
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3,
            "echo": True, "logprobs": 1}
    choice = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    check(choice["prompt_logprobs"], ids, 3)
    assert all(top is None or len(top) == 1 for top in choice["logprobs"]["top_logprobs"])
    messages = [{"role": "user", "content": "Name a fruit."}]
    reply = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "messages": messages, "max_tokens": 2, "prompt_logprobs": 2}).json()
    check(reply["prompt_logprobs"], _chat_ids(tokenizer, "Name a fruit."), 2)
    r = httpx.post(url + "/v1/completions", json={**body, "echo": False, "stream": True}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_tokenize_and_detokenize_as_vllm(fleet, tokenizer):
    """`/tokenize` gives the ids a completions prompt or a chat's messages are sent as (the usage
    of a real request agrees), `/detokenize` their text; bad input is a 400."""
    url = fleet["url"]
    text = "Tokens, counted before sending."
    r = httpx.post(url + "/tokenize", json={"prompt": text}, timeout=30).json()
    assert r["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 8192
    done = httpx.post(url + "/v1/completions", json={"prompt": text, "max_tokens": 1},
                      timeout=60).json()
    assert done["usage"]["prompt_tokens"] == r["count"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = httpx.post(url + "/tokenize", json={"messages": messages}, timeout=30).json()
    done = httpx.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1},
                      timeout=60).json()
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"]
    assert r["tokens"] == list(expected) and r["count"] == done["usage"]["prompt_tokens"]
    assert httpx.post(url + "/detokenize", json={"tokens": r["tokens"]}, timeout=30).json() == \
        {"prompt": tokenizer.decode(r["tokens"])}
    for path, body, param in [("/tokenize", {}, "prompt"),
                              ("/tokenize", {"prompt": "x", "messages": messages}, "prompt"),
                              ("/detokenize", {"tokens": [10 ** 6]}, "tokens"),
                              ("/detokenize", {"tokens": [-1]}, "tokens.0")]:
        bad = httpx.post(url + path, json=body, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    assert httpx.post(url + "/tokenize", json={"prompt": "x", "model": "gpt-9"}).status_code == 404


def test_stop_strings_cut_the_text(fleet, oracle, tokenizer):
    ids = tokenizer.encode("1, 2, 3, 4,", add_special_tokens=False)
    full = tokenizer.decode(oracle(ids, 20), skip_special_tokens=True)
    stop = full[4:6]
    assert stop and stop in full
    r = httpx.post(fleet["url"] + "/v1/completions", timeout=60,
                   json={"prompt": "1, 2, 3, 4,", "max_tokens": 20, "temperature": 0, "stop": [stop]})
    choice = r.json()["choices"][0]
    assert choice["text"] == full[: full.index(stop)] and choice["finish_reason"] == "stop"


def test_penalties_and_logit_bias_reach_the_worker(fleet, oracle, tokenizer):
    prompt = "one two three one two three one two three"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    penalties = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.25}
    expected = tokenizer.decode(oracle(ids, 24, **penalties), skip_special_tokens=True)
    assert expected != tokenizer.decode(oracle(ids, 24), skip_special_tokens=True)
    r = httpx.post(fleet["url"] + "/v1/completions", timeout=60,
                   json={"prompt": prompt, "max_tokens": 24, "temperature": 0, **penalties})
    assert r.json()["choices"][0]["text"] == expected
    fish = tokenizer.encode(" fish", add_special_tokens=False)
    assert len(fish) == 1
    r = httpx.post(fleet["url"] + "/v1/completions", timeout=60,
                   json={"prompt": prompt, "max_tokens": 3, "temperature": 0,
                         "logit_bias": {str(fish[0]): 100}})
    assert r.json()["choices"][0]["text"] == " fish" * 3


def test_n_choices_are_seeded_requests_of_their_own(fleet, oracle, tokenizer):
    prompt = "Once upon a time"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    sampling = {"temperature": 0.9, "top_p": 0.95}
    expected_ids = [oracle(ids, 12, seed=40 + i, **sampling) for i in range(3)]
    expected = [tokenizer.decode(t, skip_special_tokens=True) for t in expected_ids]
    assert len(set(expected)) == 3  # the seeds differ, so do the choices
    r = httpx.post(fleet["url"] + "/v1/completions", timeout=60,
                   json={"prompt": prompt, "max_tokens": 12, "n": 3, "seed": 40, **sampling}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert [c["text"] for c in r["choices"]] == expected
    assert r["usage"]["prompt_tokens"] == len(ids)  # the prompt once, not once per choice
    assert r["usage"]["completion_tokens"] == sum(len(t) for t in expected_ids)

    chat = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 10,
            "n": 2, "seed": 7, **sampling}
    whole = httpx.post(fleet["url"] + "/v1/chat/completions", timeout=60, json=chat).json()
    texts = {0: "", 1: ""}
    usage = None
    with httpx.stream("POST", fleet["url"] + "/v1/chat/completions", timeout=60,
                      json={**chat, "stream": True, "stream_options": {"include_usage": True}}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                for c in chunk["choices"]:
                    texts[c["index"]] += c["delta"].get("content", "")
                usage = chunk.get("usage") or usage
    assert [texts[0], texts[1]] == [c["message"]["content"] for c in whole["choices"]]
    details = usage.pop("prompt_tokens_details")
    assert usage == {k: v for k, v in whole["usage"].items() if k != "prompt_tokens_details"}
    assert usage["completion_tokens"] > 10  # both choices counted
    # The same prompt again: every full block but the last token's was cached by `whole`.
    assert details["cached_tokens"] == (usage["prompt_tokens"] - 1) // 16 * 16
    assert whole["usage"]["prompt_tokens_details"]["cached_tokens"] <= details["cached_tokens"]


def _prefix_cache_tokens(fleet, url: str | None = None) -> tuple[float, float]:
    """A worker's prefix-cache counters (w0's unless its metrics `url` is given): (tokens looked
    up, tokens found)."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {s.name: s.value for f in text_string_to_metric_families(
        httpx.get(url or fleet["metrics"]["worker"], timeout=10).text) for s in f.samples}
    return values["shoal_prefix_cache_queries_total"], values["shoal_prefix_cache_hits_total"]


def test_prompts_sent_again_and_choices_reuse_cached_prefixes(fleet, oracle, tokenizer):
    prompt = "The history of the river, told from its source to the sea. " * 6
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert len(ids) > 64
    cached = (len(ids) - 1) // 16 * 16  # every full block but one holding the last token
    expected = tokenizer.decode(oracle(ids, 8), skip_special_tokens=True)
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "cache_salt": "test-reuse"}
    queries, hits = _prefix_cache_tokens(fleet)
    first = httpx.post(fleet["url"] + "/v1/completions", timeout=60, json=body).json()
    assert first["choices"][0]["text"] == expected
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert _prefix_cache_tokens(fleet) == (queries + len(ids), hits)
    second = httpx.post(fleet["url"] + "/v1/completions", timeout=60, json=body).json()
    assert second["choices"][0]["text"] == expected
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}
    assert _prefix_cache_tokens(fleet) == (queries + 2 * len(ids), hits + cached)
    # Another salt finds nothing; three choices of a new prompt compute it once.
    httpx.post(fleet["url"] + "/v1/completions", timeout=60, json={**body, "cache_salt": "other"})
    assert _prefix_cache_tokens(fleet)[1] == hits + cached
    r = httpx.post(fleet["url"] + "/v1/completions", timeout=60,
                   json={**body, "prompt": prompt + " Again.", "n": 3, "max_tokens": 4,
                         "temperature": 0.8, "seed": 3, "cache_salt": "test-choices"}).json()
    assert len(r["choices"]) == 3
    assert r["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # choice 0 computed it
    more = (len(tokenizer.encode(prompt + " Again.", add_special_tokens=False)) - 1) // 16 * 16
    assert _prefix_cache_tokens(fleet)[1] == hits + cached + 2 * more


def test_choices_go_to_the_worker_that_holds_their_prompt(fleet, tokenizer):
    """Two workers of equal room: placement by free K/V alone would alternate the choices and
    compute the prompt on both; following the prefix, one worker computes it once."""
    port = free_port()
    twin = spawn_worker(fleet, "w-twin", 256 << 20, "--metrics-port", str(port))
    twin_metrics = f"http://127.0.0.1:{port}/metrics"
    try:
        prompt = "A ledger of the harbour's ships, their cargo and their crews. " * 5
        n = len(tokenizer.encode(prompt, add_special_tokens=False))
        before = [_prefix_cache_tokens(fleet, url)[1] for url in (None, twin_metrics)]
        r = httpx.post(fleet["url"] + "/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": 4, "n": 4, "temperature": 0.7, "seed": 5,
            "cache_salt": "test-twin"})
        assert len(r.json()["choices"]) == 4
        after = [_prefix_cache_tokens(fleet, url)[1] for url in (None, twin_metrics)]
        assert sum(after) - sum(before) == 3 * ((n - 1) // 16 * 16)
    finally:
        twin.send_signal(signal.SIGTERM)
        assert twin.wait(60) == 0


def test_a_speculating_worker_streams_the_tokens_of_plain_decoding(fleet, oracle, tokenizer):
    """A worker with --speculative-config (the roomiest, so it gets the request) yields several
    tokens per iteration; the scheduler and gateway pass them on in order, equal to plain
    greedy decoding, streamed or not, and its metrics count the drafts kept."""
    from prometheus_client.parser import text_string_to_metric_families

    port = free_port()
    spec = spawn_worker(fleet, "w-spec", 1 << 30, "--metrics-port", str(port),
                        "--speculative-config", '{"num_speculative_tokens": 4, '
                                                '"prompt_lookup_min": 1}')
    try:
        prompt = "apples, pears, plums, cherries, apples, pears, plums, cherries, apples, pears,"
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        expected = tokenizer.decode(oracle(ids, 40, ignore_eos=True), skip_special_tokens=True)
        body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                "cache_salt": "test-spec"}
        r = httpx.post(fleet["url"] + "/v1/completions", timeout=60, json=body).json()
        assert r["choices"][0]["text"] == expected
        assert r["usage"]["completion_tokens"] == 40
        with httpx.stream("POST", fleet["url"] + "/v1/completions", timeout=60,
                          json={**body, "stream": True}) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == expected
        values = {m.name: m.value for f in text_string_to_metric_families(
            httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text) for m in f.samples}
        kept = values["shoal_spec_decode_num_accepted_tokens_total"]
        assert 0 < kept <= values["shoal_spec_decode_num_draft_tokens_total"]
    finally:
        spec.send_signal(signal.SIGTERM)
        assert spec.wait(60) == 0


def test_completions_default_to_16_tokens_as_openai(fleet):
    r = httpx.post(fleet["url"] + "/v1/completions", timeout=60,
                   json={"prompt": "Once upon a time", "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16


def test_models_health_and_readiness(fleet):
    assert httpx.get(fleet["url"] + "/healthz").json()["status"] == "ok"
    assert httpx.get(fleet["url"] + "/readyz").status_code == 200
    (card,) = httpx.get(fleet["url"] + "/v1/models").json()["data"]
    assert card["id"] == "SmolLM2-135M-Instruct" and card["object"] == "model"
    assert card["max_model_len"] == 8192 and card["root"].endswith(".gguf")
    from openai import NotFoundError, OpenAI

    client = OpenAI(base_url=fleet["url"] + "/v1", api_key="none")
    retrieved = client.models.retrieve("SmolLM2-135M-Instruct").model_dump()
    assert {k: retrieved[k] for k in card} == card
    with pytest.raises(NotFoundError):
        client.models.retrieve("no/such-model")


def test_sagemakers_invocations_route_serves_chat_and_completions(fleet):
    """vLLM's `/invocations` (SageMaker's): a body with `messages` is answered as chat, one with
    `prompt` as completions, the same as on their own routes; anything else gets a 400."""
    chat = {"messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 8,
            "temperature": 0}
    completion = {"prompt": "The sky is", "max_tokens": 8, "temperature": 0}
    for body, path, key in ((chat, "/v1/chat/completions", "message"),
                            (completion, "/v1/completions", "text")):
        direct = httpx.post(fleet["url"] + path, json=body, timeout=60).json()
        r = httpx.post(fleet["url"] + "/invocations", json=body, timeout=60)
        assert r.status_code == 200
        assert r.json()["object"] == direct["object"]
        assert r.json()["choices"][0][key] == direct["choices"][0][key]
    for raw in (b"{nope", b"[1]", json.dumps({"input": "x"}).encode(),
                json.dumps({**completion, "max_tokens": 0}).encode()):
        r = httpx.post(fleet["url"] + "/invocations", content=raw, timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"], raw
    assert httpx.post(fleet["url"] + "/invocations", json={**completion, "max_tokens": 0},
                      timeout=30).json()["error"]["param"] == "max_tokens"
    assert httpx.post(fleet["url"] + "/ping", timeout=30).json() == {"status": "ok"}


def test_shoal_up_serves_and_stops_cleanly():
    port = free_port()
    up = subprocess.Popen([*shoal_command(), "up", "--port", str(port),
                           "--kv-cache-bytes", str(128 << 20), "--threads", "1",
                           "--metrics-port-base", "0"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = ""
        deadline = time.monotonic() + 180
        while "ready at" not in line and time.monotonic() < deadline:
            line = up.stdout.readline()
            assert line or up.poll() is None, "shoal up exited early"
        chat = subprocess.run([*shoal_command(), "chat", "--url",
                               f"http://127.0.0.1:{port}", "--max-tokens", "12",
                               "What is the capital of France?"], capture_output=True, text=True,
                              timeout=120)
        assert chat.returncode == 0 and "Paris" in chat.stdout, chat.stdout + chat.stderr
        children = subprocess.run(["pgrep", "-P", str(up.pid)], capture_output=True, text=True)
        pids = [int(p) for p in children.stdout.split()]
        assert len(pids) >= 4  # redis, scheduler, worker, gateway
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0
    time.sleep(0.5)
    for pid in pids:
        assert subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode != 0, pid


def test_bench_serve_sweep_writes_its_json_and_plots(fleet, tmp_path):
    out = tmp_path / "serve.json"
    r = subprocess.run([*shoal_command(), "bench", "serve", "--quick", "--url", fleet["url"],
                        "--arrival", "poisson", "--rates", "4,16", "--label", "iteration-level",
                        "--output", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    figures = json.loads(out.read_text())
    assert [run["rate"] for run in figures["runs"]] == [4.0, 16.0]
    # Output lengths are forced: every request generated exactly its max_tokens.
    from shoal.workloads import W64_QUICK, make_requests

    expected = sum(q.max_tokens for q in make_requests(W64_QUICK, 49152, 0))
    for run in figures["runs"]:
        assert run["errors"] == 0 and run["requests"] == 8
        assert run["generated_tokens"] == expected
        for t in run["per_request"]:
            assert t["ttft_s"] is not None and t["e2e_s"] >= t["ttft_s"]
            assert abs(t["normalized_latency_s"] - t["e2e_s"] / t["output_tokens"]) < 1e-9
    for suffix in ("throughput-latency", "ttft", "itl"):
        png = tmp_path / f"serve-{suffix}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


def test_placement_follows_free_kv_and_disconnects_free_blocks(fleet):
    """w0 has 364 K/V blocks, w-big 728. Each request reserves prompt + max_tokens = 126 blocks,
    so w-big takes the first three (728 -> 602 -> 476 -> 350 < 364) and w0 the fourth. Clients
    that go away are cancelled and every block comes back."""
    import redis

    from shoal.messages import decode

    r = redis.Redis.from_url(fleet["redis"])
    big = spawn_worker(fleet, "w-big", 512 << 20)

    def info(wid):
        return decode(r.hget(f"shoal:worker:{wid}", "info"))

    client = httpx.Client(timeout=120)
    streams: list = []

    def close_all():
        while streams:
            streams.pop()[0].__exit__(None, None, None)

    try:
        assert (info("w0").num_total_blocks, info("w-big").num_total_blocks) == (364, 728)
        for i in range(4):  # one at a time, each running before the next arrives
            cm = client.stream("POST", fleet["url"] + "/v1/completions", json={
                "prompt": "Tell a long story.", "max_tokens": 2000 - 5, "temperature": 0,
                "ignore_eos": True, "stream": True})
            lines = cm.__enter__().iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            streams.append((cm, lines))  # keep the generator: collecting it closes the stream
        time.sleep(2.5)  # heartbeats every second carry the running count
        assert (info("w-big").num_running, info("w0").num_running) == (3, 1)
        close_all()  # the clients go away mid-stream
        deadline = time.monotonic() + 30
        while info("w-big").num_free_blocks != 728 or info("w0").num_free_blocks != 364 \
                or info("w-big").num_running or info("w0").num_running:
            assert time.monotonic() < deadline, (info("w0"), info("w-big"))
            time.sleep(0.2)
    finally:
        close_all()
        client.close()
        big.send_signal(signal.SIGTERM)
        assert big.wait(60) == 0


def test_a_batch_of_prompts_gets_its_choices_in_order(fleet, oracle, tokenizer):
    prompts = ["The sky is", "My favourite food is"]
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in prompts]
    expected = [tokenizer.decode(oracle(i, 6), skip_special_tokens=True) for i in ids]
    assert expected[0] != expected[1]
    for prompt in (prompts, ids):  # strings, or lists of token ids
        r = httpx.post(fleet["url"] + "/v1/completions", timeout=60,
                       json={"prompt": prompt, "max_tokens": 6, "temperature": 0, "n": 2}).json()
        # Choice k * n + i is choice i of prompt k (OpenAI's order); greedy choices agree.
        assert [(c["index"], c["text"]) for c in r["choices"]] == \
            [(0, expected[0]), (1, expected[0]), (2, expected[1]), (3, expected[1])]
        assert r["usage"]["prompt_tokens"] == len(ids[0]) + len(ids[1])  # each prompt once
    text: dict[int, str] = {}
    with httpx.stream("POST", fleet["url"] + "/v1/completions", timeout=60, json={
            "prompt": prompts, "max_tokens": 6, "temperature": 0, "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    text[c["index"]] = text.get(c["index"], "") + c["text"]
    assert text == {0: expected[0], 1: expected[1]}
    too_many = httpx.post(fleet["url"] + "/v1/completions", timeout=60,
                          json={"prompt": ["x"] * 20, "n": 16})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"


def test_a_chat_batch_answers_each_conversation_as_chat_does(fleet, oracle, tokenizer):
    """vLLM's /v1/chat/completions/batch: choice k is conversation k's greedy reply, with its
    logprobs; usage counts every conversation's prompt."""
    conversations = [[{"role": "user", "content": "What is two plus two?"}],
                     [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Name a colour."}],
                     [{"role": "user", "content": "Say hello."}]]
    ids = [list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])
           for c in conversations]
    expected = [oracle(i, 8) for i in ids]
    r = httpx.post(fleet["url"] + "/v1/chat/completions/batch", timeout=60, json={
        "messages": conversations, "max_tokens": 8, "temperature": 0, "logprobs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for choice, tokens in zip(body["choices"], expected):
        assert choice["message"]["content"] == tokenizer.decode(tokens, skip_special_tokens=True)
        assert len(choice["logprobs"]["content"]) == len(tokens)
    assert body["usage"]["prompt_tokens"] == sum(map(len, ids))
    assert body["usage"]["completion_tokens"] == sum(map(len, expected))
    for bad, param in (({"stream": True}, "stream"), ({"n": 2}, "n"),
                       ({"messages": [[]]}, "messages.0"), ({"messages": []}, "messages"),
                       ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools")):
        r = httpx.post(fleet["url"] + "/v1/chat/completions/batch", timeout=30,
                       json={"messages": conversations, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)


def _http_chunks(url: str, path: str, body: dict) -> list[bytes]:
    """The payloads of a chunked HTTP/1.1 response, one per chunk as the server framed it (one
    per write of the gateway), read off a raw socket."""
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(url)
    data = json.dumps(body).encode()
    with socket.create_connection((u.hostname, u.port), timeout=60) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json"
                     f"\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    payloads = []
    while True:
        size, _, rest = rest.partition(b"\r\n")
        if int(size, 16) == 0:
            return payloads
        payloads.append(rest[:int(size, 16)])
        rest = rest[int(size, 16) + 2:]


def test_a_stream_ends_in_one_write(fleet):
    """Each token goes out as soon as it is known; the event that ends the stream goes out with
    the usage chunk, `data: [DONE]` and the end of the body in one write."""
    for n in (1, 2):
        payloads = _http_chunks(fleet["url"], "/v1/completions", {
            "prompt": "Count to ten:", "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "n": n, "stream": True, "stream_options": {"include_usage": True}})
        *tokens, end = [p.decode().split("\n\n")[:-1] for p in payloads]
        assert all(len(events) == 1 for events in tokens)  # one event a write until the end
        # A token whose text the detokenizer holds back (part of a character) sends nothing.
        assert 1 <= len(tokens) <= 5 * n - 1
        last, usage, done = (json.loads(e[6:]) if e != "data: [DONE]" else e for e in end)
        assert last["choices"][0]["finish_reason"] == "length"
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5 * n
        assert done == "data: [DONE]"


def test_continuous_usage_stats_count_each_choices_tokens_so_far(fleet):
    """vLLM's `continuous_usage_stats`: every chunk carries its choice's usage so far, which
    ends at the choice's length; the usage chunk still sums the choices."""
    events = _sse(fleet["url"] + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": 6, "n": 2,
        "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    *chunks, total = events
    prompt = total["usage"]["prompt_tokens"]
    for i in (0, 1):
        mine = [c for c in chunks if c["choices"][0]["index"] == i]
        counts = [c["usage"]["completion_tokens"] for c in mine]
        assert counts[0] == 0 and mine[0]["choices"][0]["delta"]["role"] == "assistant"
        assert counts == sorted(counts) and counts[-1] == 6
        assert all(c["usage"]["prompt_tokens"] == prompt for c in mine)
        assert all(c["usage"]["total_tokens"] == prompt + n for c, n in zip(mine, counts))
    assert total["choices"] == [] and total["usage"]["completion_tokens"] == 12


def test_a_client_gone_cancels_every_choice(fleet):
    import redis

    from shoal.messages import decode

    r = redis.Redis.from_url(fleet["redis"])

    def info():
        return decode(r.hget("shoal:worker:w0", "info"))

    total = info().num_total_blocks
    with httpx.Client(timeout=120) as client, client.stream(
            "POST", fleet["url"] + "/v1/completions", json={
                "prompt": "Tell a long story.", "max_tokens": 1995, "n": 2, "temperature": 0.8,
                "ignore_eos": True, "stream": True}) as s:
        lines = s.iter_lines()
        seen = {json.loads(line[6:])["choices"][0]["index"] for line in itertools.islice(
            (x for x in lines if x.startswith("data: {")), 40)}
        assert seen == {0, 1}
        deadline = time.monotonic() + 10
        while info().num_running != 2:  # heartbeats every second carry the running count
            assert time.monotonic() < deadline, info()
            time.sleep(0.2)
    deadline = time.monotonic() + 30
    while info().num_running or info().num_free_blocks != total:
        assert time.monotonic() < deadline, info()
        time.sleep(0.2)


def test_worker_drains_on_sigterm(fleet):
    """A second, larger worker joins and gets the next requests (most free K/V); SIGTERM mid-
    generation: it finishes what it runs, deregisters and exits 0; the clients get full replies."""
    import threading

    import redis

    from shoal.messages import decode

    r = redis.Redis.from_url(fleet["redis"])
    w = spawn_worker(fleet, "w-drain", 512 << 20)
    try:
        results = []

        def one(i):
            results.append(httpx.post(fleet["url"] + "/v1/completions", timeout=300, json={
                "prompt": f"Count slowly to {i}:", "max_tokens": 120, "temperature": 0,
                "ignore_eos": True}).json())

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while True:  # the heartbeat (every second) reports what it runs
            raw = r.hget("shoal:worker:w-drain", "info")
            if raw and decode(raw).num_running > 0:
                break
            assert time.monotonic() < deadline, "w-drain never ran a request"
            time.sleep(0.05)
        w.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(300)
        assert w.wait(120) == 0
        assert [res["usage"]["completion_tokens"] for res in results] == [120] * 4, results
        assert not r.sismember("shoal:workers", "w-drain")
    finally:
        if w.poll() is None:
            w.kill()


def test_worker_that_cannot_read_its_plans_leaves_the_fleet(fleet):
    """A plan the worker cannot read (here one that is not a message): the worker leaves the
    fleet and exits 1 instead of hanging with its heartbeat still beating; the fleet keeps
    serving."""
    import redis

    r = redis.Redis.from_url(fleet["redis"])
    w = spawn_worker(fleet, "w-garbled", 64 << 20)
    try:
        r.rpush("shoal:plans:w-garbled", b"not a plan")
        assert w.wait(60) == 1
        assert not r.sismember("shoal:workers", "w-garbled")
        reply = httpx.post(fleet["url"] + "/v1/completions", timeout=120, json={
            "prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True}).json()
        assert reply["usage"]["completion_tokens"] == 3, reply
    finally:
        if w.poll() is None:
            w.kill()
