"""LoRA adapters served beside the real model: a request with an adapter decodes as the model
with the adapter merged into its weights would (the oracle), in batches that mix adapters and
the base model; the prefix cache keeps an adapter's K/V apart; bad adapters and unknown names
get clear errors; through a real fleet a request names an adapter as its `model`. The
adapters are random (a real one for SmolLM2 is not at hand): what is tested is that each row
gets exactly its own adapter's `W + s B A`."""

from __future__ import annotations

import json

import pytest
import torch

from shoal.sampling_params import SamplingParams
from tests.conftest import make_engine
from worker.lora import FUSED, LoRAError, load_adapter
from worker.offline import NewRequest, generate

PROMPT = "The three primary colors are"


def write_adapter(path, cfg, seed: int, r: int = 8, alpha: float = 16.0,
                  modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                           "down_proj"), std: float = 0.05) -> dict[str, tuple]:
    """A random PEFT adapter in `path`; returns its (A, B) float32 by weight name."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"q_proj": (q, cfg.hidden_size), "k_proj": (kv, cfg.hidden_size),
              "v_proj": (kv, cfg.hidden_size), "o_proj": (cfg.hidden_size, q),
              "gate_proj": (cfg.intermediate_size, cfg.hidden_size),
              "up_proj": (cfg.intermediate_size, cfg.hidden_size),
              "down_proj": (cfg.hidden_size, cfg.intermediate_size)}
    tensors, pairs = {}, {}
    for i in range(cfg.num_layers):
        for mod in modules:
            out, inp = shapes[mod]
            part = "self_attn" if mod in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"model.layers.{i}.{part}.{mod}.weight"
            a = torch.randn(r, inp, generator=g) * std
            b = torch.randn(out, r, generator=g) * std
            key = f"base_model.model.model.layers.{i}.{part}.{mod}"
            tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
            pairs[name] = (a, b)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"r": r, "lora_alpha": alpha, "peft_type": "LORA", "target_modules": list(modules)}))
    return {name: (a, b, alpha / r) for name, (a, b) in pairs.items()}


def merged(model, pairs):
    """The model with an adapter merged: each targeted weight `W + s B A` (float32)."""
    cfg, weights = model
    out = dict(weights)
    for name, (a, b, scale) in pairs.items():
        out[name] = weights[name] + scale * (b @ a)
    return cfg, out


@pytest.fixture(scope="module")
def adapters(fp32_model, tmp_path_factory):
    """Two random adapters: one on every projection, one on the attention's q and v only."""
    cfg = fp32_model[0]
    root = tmp_path_factory.mktemp("lora")
    return {"all": (root / "all", write_adapter(root / "all", cfg, seed=1)),
            "qv": (root / "qv", write_adapter(root / "qv", cfg, seed=2,
                                              modules=("q_proj", "v_proj"), std=0.08))}


def _greedy(engine, ids, lora=None, max_tokens=24, rid="r"):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            lora_name=lora)
    return NewRequest(rid, ids, params)


def test_each_request_decodes_as_its_adapter_merged_would(fp32_model, adapters, tokenizer):
    """One batch of three requests, two adapters and the base model, prefill and decode: each
    gives the greedy tokens of the model with its own adapter merged into the weights (and
    the base request the base model's), and the adapters do change the reply."""
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    engine = make_engine(fp32_model, lora_modules=tuple((k, str(p)) for k, (p, _) in
                                                        adapters.items()))
    out = generate(engine, [_greedy(engine, ids, "all", rid="a"),
                            _greedy(engine, ids, None, rid="b"),
                            _greedy(engine, ids, "qv", rid="c")])
    base = generate(make_engine(fp32_model), [_greedy(None, ids)])["r"].token_ids
    assert out["b"].token_ids == base
    for rid, name in (("a", "all"), ("c", "qv")):
        oracle = generate(make_engine(merged(fp32_model, adapters[name][1])),
                          [_greedy(None, ids)])["r"].token_ids
        assert out[rid].token_ids == oracle and oracle != base, name


def test_an_adapter_s_cached_prefix_is_its_own(fp32_model, adapters, tokenizer):
    """After the base model ran a prompt, the same prompt with an adapter finds none of its
    blocks in the prefix cache (their K/V differ) and decodes as the merged model; a second
    request with the adapter finds its own, and decodes the same."""
    ids = tokenizer.encode(PROMPT * 4, add_special_tokens=False)
    path, pairs = adapters["all"]
    engine = make_engine(fp32_model, lora_modules=(("all", str(path)),))
    generate(engine, [_greedy(engine, ids, None)])
    hits = engine.prefix_cache_hits
    with_adapter = generate(engine, [_greedy(engine, ids, "all")])["r"].token_ids
    oracle = generate(make_engine(merged(fp32_model, pairs)), [_greedy(None, ids)])["r"]
    assert engine.prefix_cache_hits == hits and with_adapter == oracle.token_ids
    again = generate(engine, [_greedy(engine, ids, "all")])["r"].token_ids
    assert engine.prefix_cache_hits > hits and again == with_adapter


def test_bad_adapters_and_unknown_names_get_clear_errors(fp32_model, adapters, tmp_path,
                                                          tokenizer):
    cfg = fp32_model[0]
    with pytest.raises(LoRAError, match="cannot read"):
        load_adapter("x", tmp_path / "missing", cfg, torch.float32)
    bad = tmp_path / "bad"
    write_adapter(bad, cfg, seed=3, r=4, modules=("q_proj",))
    (bad / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 8}))
    with pytest.raises(LoRAError, match="expected A"):
        load_adapter("bad", bad, cfg, torch.float32)
    adapter = load_adapter("qv", adapters["qv"][0], cfg, torch.float32)
    assert set(adapter.layers[0]) == {"qkv"} and set(FUSED) >= set(adapter.layers[-1])
    engine = make_engine(fp32_model)
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    out = generate(engine, [_greedy(engine, ids, "nope")])["r"]
    assert out.finish_reason == "error" and "'nope' is not loaded" in out.error


def test_a_fleet_serves_adapters_as_models(fp32_model, adapters, tokenizer):
    """`--lora-modules` on the gateway and the worker: `/v1/models` lists the adapter with
    its base model as `parent`; a chat request naming it is answered under its name with
    the merged model's greedy reply, streamed or not, while the base model's requests in
    the same fleet get the base reply; bad flags are refused with a message."""
    import httpx

    from shoal import cli
    from tests.conftest import running_fleet

    path, pairs = adapters["all"]
    flag = ("--lora-modules", f"sql={path}")
    messages = [{"role": "user", "content": "Name three colors."}]
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"])

    def reply(model) -> str:
        out = generate(make_engine(model), [NewRequest("r", ids, SamplingParams(
            max_tokens=16, temperature=0.0))])["r"]
        return tokenizer.decode(out.token_ids, skip_special_tokens=True)
    with running_fleet(worker_args=flag, gateway_args=flag) as fleet:
        cards = httpx.get(fleet["url"] + "/v1/models", timeout=30).json()["data"]
        assert [(c["id"], c["parent"], c["root"]) for c in cards[1:]] == \
            [("sql", "SmolLM2-135M-Instruct", str(path))]
        ask = {"messages": messages, "max_tokens": 16, "temperature": 0}
        tuned = httpx.post(fleet["url"] + "/v1/chat/completions", timeout=60,
                           json={**ask, "model": "sql"}).json()
        base = httpx.post(fleet["url"] + "/v1/chat/completions", timeout=60, json=ask).json()
        assert tuned["model"] == "sql" and base["model"] == "SmolLM2-135M-Instruct"
        assert tuned["choices"][0]["message"]["content"] == reply(merged(fp32_model, pairs))
        assert base["choices"][0]["message"]["content"] == reply(fp32_model)
        off = httpx.post(fleet["url"] + "/v1/load_lora_adapter", timeout=30,
                         json={"lora_name": "x", "lora_path": str(path)})
        assert off.status_code == 404 and "--allow-runtime-lora-updating" in \
            off.json()["error"]["message"]
        with httpx.stream("POST", fleet["url"] + "/v1/chat/completions", timeout=60,
                          json={**ask, "model": "sql", "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c["choices"]) == tuned["choices"][0]["message"]["content"]
    for bad, message in ((["sql"], "expected NAME=PATH"), ([f"a={path}", f"a={path}"], "twice"),
                         ([f"a={path}/missing"], "not a directory")):
        with pytest.raises(cli.CLIError, match=message):
            cli._lora_modules(bad)


def test_adapters_load_and_unload_while_the_fleet_runs(fp32_model, adapters, tokenizer,
                                                        tmp_path):
    """vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` through a real fleet: a
    loaded adapter is a model of every gateway (one started apart learns it from Redis) and
    answers as the merged model would, beside the base model; a worker that joins later loads
    it as it starts; an unreadable adapter is refused naming the worker's reason and is not
    listed; a name taken, or unknown to unload, gets its error; once unloaded, requests naming
    it get 404."""
    import httpx
    import redis

    from shoal.messages import decode
    from tests.conftest import extra_gateway, running_fleet, spawn_worker

    path, pairs = adapters["all"]
    messages = [{"role": "user", "content": "Name three colors."}]
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"])
    expected = tokenizer.decode(generate(make_engine(merged(fp32_model, pairs)), [NewRequest(
        "r", ids, SamplingParams(max_tokens=16, temperature=0.0))])["r"].token_ids,
        skip_special_tokens=True)
    ask = {"messages": messages, "max_tokens": 16, "temperature": 0}
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    with running_fleet(gateway_args=("--allow-runtime-lora-updating",)) as fleet:
        url = fleet["url"]

        def load(name, where, **kw):
            return httpx.post(url + "/v1/load_lora_adapter", timeout=120,
                              json={"lora_name": name, "lora_path": str(where), **kw})

        def names(base=url):
            return [c["id"] for c in httpx.get(base + "/v1/models", timeout=30).json()["data"]]

        assert names() == ["SmolLM2-135M-Instruct"]
        r = load("sql", path)
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' added successfully."
        cards = httpx.get(url + "/v1/models", timeout=30).json()["data"]
        assert [(c["id"], c["parent"], c["root"]) for c in cards] == [
            ("SmolLM2-135M-Instruct", None, cards[0]["root"]),
            ("sql", "SmolLM2-135M-Instruct", str(path))]
        tuned = httpx.post(url + "/v1/chat/completions", timeout=60,
                           json={**ask, "model": "sql"}).json()
        assert tuned["model"] == "sql" and tuned["choices"][0]["message"]["content"] == expected
        assert load("sql", path).status_code == 400  # already loaded
        assert "already been loaded" in load("sql", path).json()["error"]["message"]
        assert load("SmolLM2-135M-Instruct", path).status_code == 400  # the model's own name

        bad = load("broken", broken)
        assert bad.status_code == 400 and "worker w0" in bad.json()["error"]["message"]
        assert names() == ["SmolLM2-135M-Instruct", "sql"]

        with extra_gateway(fleet, "--allow-runtime-lora-updating") as url2:
            worker = spawn_worker(fleet, "w1", 64 << 20)
            try:
                assert "sql" in names(url2)  # learned from Redis, not loaded through it
                # The worker that joined loaded the fleet's adapter before its first heartbeat.
                info = decode(redis.Redis.from_url(fleet["redis"]).hget("shoal:worker:w1", "info"))
                assert info.loras == {"sql": str(path)}
                # A load waits for both workers.
                assert load("qv", adapters["qv"][0]).status_code == 200
                again = httpx.post(url2 + "/v1/chat/completions", timeout=60,
                                   json={**ask, "model": "sql"}).json()
                assert again["choices"][0]["message"]["content"] == expected

                r = httpx.post(url2 + "/v1/unload_lora_adapter", timeout=120,
                               json={"lora_name": "sql"})
                assert r.status_code == 200 and "removed" in r.text
                assert names() == names(url2) == ["SmolLM2-135M-Instruct", "qv"]
                gone = httpx.post(url + "/v1/chat/completions", timeout=60,
                                  json={**ask, "model": "sql"})
                assert gone.status_code == 404
                assert httpx.post(url + "/v1/unload_lora_adapter", timeout=30,
                                  json={"lora_name": "sql"}).status_code == 404
            finally:
                worker.terminate()
                worker.wait(timeout=60)


def test_in_bfloat16_an_adapter_s_logits_are_the_merged_model_s(model_path, adapters,
                                                                 tokenizer):
    """The serving dtype: bfloat16 rounds the merged weights and the unmerged deltas apart,
    so the check is on logits, for one row (the float32 delta) and a prefill of many (the
    bfloat16 one): the adapter moves them far from the base model's and lands within
    rounding of the merged model's."""
    from worker.loader import load_model

    model = load_model(model_path, torch.bfloat16)
    path, pairs = adapters["all"]
    ids = tokenizer.encode(PROMPT * 3, add_special_tokens=False)
    fp32_pairs = {n: (a, b, s) for n, (a, b, s) in pairs.items()}
    cfg, weights = model
    merged_bf16 = (cfg, {**weights, **{n: (weights[n].float() + s * (b @ a)).bfloat16()
                                       for n, (a, b, s) in fp32_pairs.items()}})

    def logits(m, lora=None, **kw):
        engine = make_engine(m, dtype=torch.bfloat16, keep_logits=True, **kw)
        generate(engine, [_greedy(engine, ids, lora, max_tokens=2)])
        return engine.last_logits["r"].float()
    tuned = logits(model, "all", lora_modules=(("all", str(path)),))
    oracle, base = logits(merged_bf16), logits(model)
    assert (tuned - oracle).abs().max() < 0.2 * (tuned - base).abs().max()
