"""vLLM's extra request parameters (stop_token_ids, include_stop_str_in_output,
skip_special_tokens, allowed_token_ids, bad_words, return_tokens_as_token_ids,
truncate_prompt_tokens; for chat add_generation_prompt,
continue_final_message, chat_template_kwargs), `/health` and the flags --served-model-name and
--chat-template, through a real fleet against the in-process engine and the tokenizer's own chat
template."""

from __future__ import annotations

import re

import httpx
import pytest

from shoal.messages import NewRequest
from shoal.sampling_params import SamplingParams
from tests.conftest import make_engine
from worker.offline import generate

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _complete(fleet, **body) -> dict:
    r = httpx.post(fleet["url"] + "/v1/completions", json={"temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _chat(fleet, **body) -> dict:
    r = httpx.post(fleet["url"] + "/v1/chat/completions", json={"temperature": 0, **body},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _template(tokenizer, messages, **kw) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                              **kw)["input_ids"])


def test_stop_token_ids_and_stop_strings_with_or_without_the_stop(fleet, oracle, tokenizer):
    prompt = "Once upon a time"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    expected = oracle(ids, 16)
    stop = expected[5]
    cut = expected[: expected.index(stop) + 1]
    out = _complete(fleet, prompt=prompt, max_tokens=16, stop_token_ids=[stop])
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == len(cut)
    assert out["choices"][0]["text"] == tokenizer.decode(cut, skip_special_tokens=True)

    text = tokenizer.decode(expected, skip_special_tokens=True)
    word = text.split()[3]
    at = text.index(word)
    for include, end in ((False, at), (True, at + len(word))):
        out = _complete(fleet, prompt=prompt, max_tokens=16, stop=[word],
                        include_stop_str_in_output=include)
        assert out["choices"][0]["text"] == text[:end]


def test_special_tokens_are_kept_when_asked(fleet, oracle, tokenizer):
    expected = oracle(_template(tokenizer, QUESTION, add_generation_prompt=True), 24)
    assert expected[-1] == tokenizer.eos_token_id  # the answer ends within 24 tokens
    for skip in (True, False):
        out = _chat(fleet, messages=QUESTION, max_tokens=24, skip_special_tokens=skip)
        text = out["choices"][0]["message"]["content"]
        assert text == tokenizer.decode(expected, skip_special_tokens=skip)
    assert text.endswith(tokenizer.eos_token)


def test_allowed_token_ids_are_the_only_tokens_sampled(fleet, oracle, tokenizer):
    allowed = [tokenizer.encode(w, add_special_tokens=False)[0] for w in (" yes", " no")]
    prompt = "Is the sky blue? Answer:"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    out = _complete(fleet, prompt=prompt, max_tokens=6, allowed_token_ids=allowed)
    assert out["choices"][0]["text"] == tokenizer.decode(oracle(ids, 6, allowed_token_ids=allowed))
    out = _complete(fleet, prompt=prompt, max_tokens=6, temperature=1.0, seed=2, n=3,
                    allowed_token_ids=allowed)
    for c in out["choices"]:
        assert re.fullmatch("( yes| no){6}", c["text"]), c["text"]


def test_bad_words_are_never_written(fleet, oracle, tokenizer):
    """`bad_words` (vLLM's): a word of the greedy reply, banned, is not written as the text's
    first word nor after a space; the reply is the engine's with both tokenizations banned."""
    prompt = "The capital of France is"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    plain = _complete(fleet, prompt=prompt, max_tokens=12)["choices"][0]["text"]
    word = max(re.findall(r"[A-Za-z]+", plain), key=len)
    out = _complete(fleet, prompt=prompt, max_tokens=12, bad_words=[word])
    banned = tuple(tuple(tokenizer.encode(w, add_special_tokens=False)) for w in (word, " " + word))
    text = out["choices"][0]["text"]
    assert text == tokenizer.decode(oracle(ids, 12, bad_words_token_ids=banned)) != plain
    assert not re.search(rf"(^| ){word}", text), (word, text)


def test_tokens_can_be_named_by_their_ids(fleet, oracle, tokenizer):
    """`return_tokens_as_token_ids` (vLLM's): logprobs name each token, and each of its step's
    alternatives, `token_id:<id>`; the same logprobs and text offsets as with their texts."""
    prompt = "The capital of France is"
    ids = oracle(tokenizer.encode(prompt, add_special_tokens=False), 5)
    ask = {"prompt": prompt, "max_tokens": 5, "logprobs": 2}
    named, texts = (_complete(fleet, **ask, return_tokens_as_token_ids=flag)["choices"][0]["logprobs"]
                    for flag in (True, False))
    assert named["tokens"] == [f"token_id:{t}" for t in ids]
    assert texts["tokens"] == [tokenizer.decode([t]) for t in ids]
    assert named["token_logprobs"] == texts["token_logprobs"]
    assert named["text_offset"] == texts["text_offset"]
    for top_ids, top_texts in zip(named["top_logprobs"], texts["top_logprobs"]):
        assert all(re.fullmatch(r"token_id:\d+", k) for k in top_ids)
        assert sorted(top_ids.values()) == sorted(top_texts.values())
    chat = _chat(fleet, messages=QUESTION, max_tokens=4, logprobs=True, top_logprobs=2,
                 return_tokens_as_token_ids=True)["choices"][0]["logprobs"]["content"]
    for entry in chat:
        assert re.fullmatch(r"token_id:\d+", entry["token"])
        assert entry["bytes"] == list(entry["token"].encode())
        assert all(re.fullmatch(r"token_id:\d+", a["token"]) for a in entry["top_logprobs"])


def test_min_p_keeps_only_tokens_near_the_most_likely(fleet, oracle, tokenizer):
    """vLLM's `min_p`: at 1 only the most likely token survives, so even a hot temperature gives
    the greedy tokens; a small min_p still samples."""
    prompt = "Once upon a time, in a land far away,"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    greedy = tokenizer.decode(oracle(ids, 12), skip_special_tokens=True)
    out = _complete(fleet, prompt=prompt, max_tokens=12, temperature=1.5, seed=4, min_p=1.0,
                    n=2)
    assert [c["text"] for c in out["choices"]] == [greedy, greedy]
    out = _complete(fleet, prompt=prompt, max_tokens=12, temperature=1.5, seed=4, min_p=0.01,
                    n=3)
    assert any(c["text"] != greedy for c in out["choices"])


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(fleet, oracle, tokenizer):
    prompt = "The history of the city goes back many centuries, and its old town"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    out = _complete(fleet, prompt=prompt, max_tokens=8, truncate_prompt_tokens=5)
    assert out["usage"]["prompt_tokens"] == 5
    assert out["choices"][0]["text"] == tokenizer.decode(oracle(ids[-5:], 8),
                                                         skip_special_tokens=True)


def test_chat_can_continue_the_final_message_or_open_no_turn(fleet, oracle, tokenizer):
    messages = QUESTION + [{"role": "assistant", "content": "The capital of France is"}]
    ids = _template(tokenizer, messages, continue_final_message=True)
    out = _chat(fleet, messages=messages, max_tokens=8, add_generation_prompt=False,
                continue_final_message=True)
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert out["choices"][0]["message"]["content"] == tokenizer.decode(oracle(ids, 8),
                                                                       skip_special_tokens=True)
    out = _chat(fleet, messages=QUESTION, max_tokens=4, add_generation_prompt=False,
                chat_template_kwargs={"unused_variable": 1})
    assert out["usage"]["prompt_tokens"] == len(_template(tokenizer, QUESTION))


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("chat", {"continue_final_message": True}, "continue_final_message"),
    ("chat", {"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
    ("completions", {"allowed_token_ids": [99999999]}, "allowed_token_ids"),
    ("completions", {"allowed_token_ids": []}, "allowed_token_ids"),
    ("completions", {"stop_token_ids": [49152]}, "stop_token_ids"),
    ("completions", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("completions", {"min_p": 1.5}, "min_p"),
    ("completions", {"bad_words": [""]}, "bad_words.0"),
    ("chat", {"allowed_token_ids": [5], "structured_outputs": {"regex": "a"}},
     "allowed_token_ids"),
])
def test_bad_extra_parameters_get_a_400_that_names_them(fleet, path, extra, param):
    body = {"messages": QUESTION} if path == "chat" else {"prompt": "x"}
    url = fleet["url"] + ("/v1/chat/completions" if path == "chat" else "/v1/completions")
    r = httpx.post(url, json={**body, "max_tokens": 4, **extra}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


# A chat template unlike the model's own: no default system turn, the role in capitals.
PLAIN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] | upper }}\n{{ m['content'] }}"
                  "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                  "{% endif %}")


@pytest.fixture(scope="module")
def named_fleet(tmp_path_factory):
    """A fleet serving the model as "smol" (also "helper" at the gateway) through
    PLAIN_TEMPLATE, given as a file."""
    from tests.conftest import running_fleet

    template = tmp_path_factory.mktemp("template") / "plain.jinja"
    template.write_text(PLAIN_TEMPLATE)
    with running_fleet(("--served-model-name", "smol"), gateway_args=(
            "--served-model-name", "smol", "helper", "--chat-template", str(template))) as f:
        yield f


def test_served_model_names_and_chat_template_as_vllms(named_fleet, oracle, tokenizer):
    """vLLM's --served-model-name and --chat-template: /v1/models lists the names, a request
    may name any and is answered as the first, which the worker advertises; another name is a
    404. Chats are formatted by the given template: the reply is the in-process engine's greedy
    one for the template's tokens."""
    import jinja2

    url = named_fleet["url"]
    models = httpx.get(url + "/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == ["smol", "helper"]
    workers = httpx.get(url + "/v1/fleet", timeout=30).json()["workers"]
    assert [w["model"] for w in workers] == ["smol"]
    text = jinja2.Template(PLAIN_TEMPLATE).render(messages=QUESTION, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids != _template(tokenizer, QUESTION, add_generation_prompt=True)
    expected = oracle(ids, 12)
    for name in ("smol", "helper", None):
        out = _chat(named_fleet, messages=QUESTION, max_tokens=12,
                    **({"model": name} if name else {}))
        assert out["model"] == "smol" and out["usage"]["prompt_tokens"] == len(ids)
        assert out["choices"][0]["message"]["content"] == \
            tokenizer.decode(expected, skip_special_tokens=True)
    tokenized = httpx.post(url + "/tokenize", json={"messages": QUESTION, "model": "helper"},
                           timeout=30).json()
    assert tokenized["tokens"] == ids
    r = httpx.post(url + "/v1/completions", json={"model": "SmolLM2-135M-Instruct",
                                                 "prompt": "Hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_health_answers_as_vllms_does(fleet):
    assert httpx.get(fleet["url"] + "/health", timeout=10).status_code == 200


def test_allowed_tokens_hold_sampling_and_give_way_to_nothing(fp32_model, tokenizer):
    """Sampled tokens stay within `allowed_token_ids`; when they hold only the end-of-sequence
    token, `min_tokens` cannot ban it (nothing else could be sampled) and the request ends."""
    engine = make_engine(fp32_model)
    cfg, _ = fp32_model
    prompt = tokenizer.encode("Random digits: 4 9 1 7 3 0 8", add_special_tokens=False)
    allowed = tuple(tokenizer.encode(f" {d}", add_special_tokens=False)[-1] for d in range(10))
    out = generate(engine, [NewRequest("r", prompt, SamplingParams(
        max_tokens=24, temperature=1.0, seed=4, allowed_token_ids=allowed, ignore_eos=True))])["r"]
    assert len(out.token_ids) == 24 and set(out.token_ids) <= set(allowed)
    assert len(set(out.token_ids)) > 1
    out = generate(engine, [NewRequest("r", prompt, SamplingParams(
        max_tokens=8, min_tokens=4, allowed_token_ids=(cfg.eos_token_id,)))])["r"]
    assert out.token_ids == [cfg.eos_token_id] and out.finish_reason == "stop"
