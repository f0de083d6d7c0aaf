"""Several models in one fleet (docs/protocol.md, "Several models"): one gateway, workers of
each model, the scheduler placing each request only on workers of the model it names. The two
models here are the default GGUF file under two names (a link to it gives the second its own
file name): real processes, the real model, routing told apart by the workers' names."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from shoal.fleet import free_port, start_fleet
from shoal.model_files import default_model_path
from tests.conftest import finished_requests

OTHER = "Other-Model"


@pytest.fixture(scope="module")
def two_model_fleet(tmp_path_factory):
    """`shoal up --model SmolLM2 --model Other-Model --allow-runtime-lora-updating` as
    `start_fleet` runs it: one float32 worker per model (worker-0 SmolLM2's, worker-1 the
    other's), the processes' logs in a file."""
    root = tmp_path_factory.mktemp("models")
    other = root / f"{OTHER}.gguf"
    other.symlink_to(default_model_path())
    log_path = root / "fleet.log"
    with open(log_path, "w") as log:
        fleet = start_fleet("127.0.0.1", free_port(), 1, None,
                            ["--dtype", "float32", "--kv-cache-bytes", str(256 << 20),
                             "--threads", "1"], 1, metrics_port_base=0, log=log,
                            models=[str(default_model_path()), str(other)],
                            gateway_args=["--allow-runtime-lora-updating"])
        try:
            yield fleet, log_path
        finally:
            fleet.stop()


def test_each_request_runs_on_a_worker_of_the_model_it_names(two_model_fleet, oracle, tokenizer):
    fleet, log_path = two_model_fleet
    names = [m["id"] for m in httpx.get(fleet.url + "/v1/models", timeout=30).json()["data"]]
    assert names == ["SmolLM2-135M-Instruct", OTHER]
    status = httpx.get(fleet.url + "/v1/fleet", timeout=30).json()
    assert status["models"] == names and status["model"] == names[0]
    assert {w["worker_id"]: w["model"] for w in status["workers"]} == {
        "worker-0": names[0], "worker-1": OTHER}

    prompt = "The capital of France is"
    expected = tokenizer.decode(oracle(tokenizer.encode(prompt, add_special_tokens=False), 8),
                                skip_special_tokens=True)

    async def ask(model: str | None) -> dict:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                **({"model": model} if model else {})}
        async with httpx.AsyncClient(timeout=120) as client:
            r = await client.post(fleet.url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    async def all_of_them() -> list[dict]:
        models = [OTHER, names[0], None] * 3  # at once, interleaved
        return await asyncio.gather(*(ask(m) for m in models))

    replies = asyncio.run(all_of_them())
    log = {}
    for _ in range(50):  # the scheduler logs a request as it finishes: give it a moment
        log = finished_requests(log_path)
        if all(r["id"] in log for r in replies):
            break
        asyncio.run(asyncio.sleep(0.1))
    for asked, reply in zip([OTHER, names[0], None] * 3, replies):
        model = asked or names[0]
        assert reply["model"] == model
        assert reply["choices"][0]["text"] == expected  # the same weights under both names
        entry = log[reply["id"]]
        assert entry["model"] == model
        assert entry["worker"] == ("worker-1" if model == OTHER else "worker-0")

    # The gateway's token counts, per model.
    from prometheus_client.parser import text_string_to_metric_families

    counts = {s.labels["model_name"]: s.value
              for f in text_string_to_metric_families(httpx.get(fleet.url + "/metrics").text)
              for s in f.samples if s.name == "shoal_generation_tokens_total"}
    assert counts == {names[0]: 6 * 8, OTHER: 3 * 8}

    r = httpx.post(fleet.url + "/v1/chat/completions", timeout=30, json={
        "model": "gpt-9", "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert OTHER in r.json()["error"]["message"]  # it names the models there are
    tokenized = httpx.post(fleet.url + "/tokenize", json={"model": OTHER, "prompt": prompt},
                           timeout=30).json()
    assert tokenized["tokens"] == tokenizer.encode(prompt, add_special_tokens=False)


def test_an_adapter_loaded_at_run_time_serves_on_the_model_it_names(two_model_fleet, fp32_model,
                                                                     tmp_path):
    """`base_model` (shoal's field of `/v1/load_lora_adapter`) puts an adapter on the second
    model's workers alone: listed with that parent, its requests run on worker-1; a base the
    gateway does not serve is refused, and so is an in-place load onto another model; unloading
    finds the adapter under its model."""
    from tests.test_lora import write_adapter

    fleet, log_path = two_model_fleet
    url = fleet.url
    write_adapter(tmp_path / "a", fp32_model[0], seed=3)
    load = {"lora_name": "other-a", "lora_path": str(tmp_path / "a")}
    r = httpx.post(url + "/v1/load_lora_adapter", json={**load, "base_model": "Nope"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "base_model"
    assert OTHER in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/load_lora_adapter", json={**load, "base_model": OTHER}, timeout=120)
    assert r.status_code == 200, r.text
    assert httpx.get(url + "/v1/models/other-a", timeout=30).json()["parent"] == OTHER
    workers = {w["worker_id"]: w for w in httpx.get(url + "/v1/fleet", timeout=30).json()["workers"]}
    assert workers["worker-1"]["loras"] == {"other-a": str(tmp_path / "a")}
    assert workers["worker-0"]["loras"] == {}
    moved = httpx.post(url + "/v1/load_lora_adapter", json={**load, "load_inplace": True},
                       timeout=30)  # onto the first model: an in-place load may not move it
    assert moved.status_code == 400 and "unload it first" in moved.json()["error"]["message"]
    reply = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": "other-a", "prompt": "Hello", "max_tokens": 4, "temperature": 0}).json()
    for _ in range(50):
        if reply["id"] in (log := finished_requests(log_path)):
            break
        asyncio.run(asyncio.sleep(0.1))
    assert log[reply["id"]]["worker"] == "worker-1" and reply["model"] == "other-a"
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "other-a"}, timeout=120)
    assert r.status_code == 200, r.text
    r = httpx.post(url + "/v1/completions", timeout=30, json={"model": "other-a", "prompt": "Hi"})
    assert r.status_code == 404


def test_the_gateway_is_ready_only_while_every_model_has_a_worker(two_model_fleet):
    """/readyz names a model left without workers; the other model is still served."""
    import signal

    fleet, _ = two_model_fleet
    assert httpx.get(fleet.url + "/readyz", timeout=30).status_code == 200
    other_worker = fleet.workers[1]
    other_worker.send_signal(signal.SIGTERM)  # drains and deregisters
    other_worker.wait(timeout=60)
    r = httpx.get(fleet.url + "/readyz", timeout=30)
    assert r.status_code == 503 and OTHER in r.json()["detail"]
    served = httpx.post(fleet.url + "/v1/completions", timeout=60,
                        json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert served.status_code == 200
