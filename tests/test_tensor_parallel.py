"""Tensor parallelism (worker/parallel.py) on the CPU with gloo, in real processes: the split
model against the whole one, refusals, and a tensor-parallel worker in a fleet losing a rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
import torch

from shoal.fleet import (
    free_ports,
    shoal_command,
    start_redis,
    stop_all,
    wait_ready,
    worker_env,
)
from tests import tp_probe
from tests.conftest import make_engine
from worker.config import ModelConfig
from worker.parallel import TensorParallel

LOGITS_REL_MAX = 1e-4  # the bound, float32


def test_three_ranks_give_the_tokens_and_logits_of_one(fp32_model, tmp_path):
    out = tmp_path / "tp3.pt"
    r = subprocess.run([sys.executable, "-m", "tests.tp_probe", "3", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    tp3 = torch.load(out)
    cfg = tp_probe.CONFIG
    one = make_engine(fp32_model, kv_cache_bytes=cfg.kv_cache_bytes,
                      max_num_batched_tokens=cfg.max_num_batched_tokens)
    tokens, logits = tp_probe.run(one)
    assert tp3["result"][0] == tokens
    assert all(len(t) == tp_probe.MAX_TOKENS for t in tokens.values())
    for rid, expected in logits.items():
        got = tp3["result"][1][rid]
        rel = ((got - expected).norm(dim=1) / expected.norm(dim=1)).max().item()
        assert rel <= LOGITS_REL_MAX, (rid, rel)
    # Each rank's pools hold a third of the K/V heads, so the same bytes per rank hold 3x the blocks.
    assert tp3["blocks"] == 3 * one.num_total_blocks


def test_sizes_that_do_not_divide_the_heads_are_refused(fp32_model):
    cfg: ModelConfig = fp32_model[0]  # SmolLM2: 9 query heads, 3 K/V heads
    with pytest.raises(ValueError, match=r"must divide the model's query heads \(9\), K/V heads"):
        TensorParallel(0, 2).check(cfg)
    with pytest.raises(ValueError, match="K/V heads"):
        TensorParallel(0, 9).check(cfg)
    local = TensorParallel(1, 3).local_config(cfg)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (3, 1, 512)
    w = torch.randn(cfg.num_heads * cfg.head_dim, cfg.hidden_size)
    part = TensorParallel(1, 3).shard("model.layers.0.self_attn.q_proj.weight", w)
    assert torch.equal(part, w[3 * cfg.head_dim : 6 * cfg.head_dim])
    o = torch.randn(cfg.hidden_size, cfg.num_heads * cfg.head_dim)
    assert torch.equal(TensorParallel(2, 3).shard("model.layers.3.self_attn.o_proj.weight", o),
                       o[:, 6 * cfg.head_dim :])
    assert TensorParallel(2, 3).shard("model.norm.weight", o) is o  # replicated


def _follower_pids(pid: int) -> list[int]:
    import psutil

    return [c.pid for c in psutil.Process(pid).children(recursive=True)
            if "spawn_main" in " ".join(c.cmdline()) and "resource_tracker" not in " ".join(c.cmdline())]


@pytest.mark.slow
def test_tensor_parallel_worker_serves_and_losing_a_rank_migrates_its_requests(tokenizer):
    rport, gport = free_ports(2)
    redis_proc = start_redis(rport)
    url = f"redis://127.0.0.1:{rport}/0"
    base = f"http://127.0.0.1:{gport}"

    def shoal(*args, **kw):
        return subprocess.Popen([*shoal_command(), *args], **kw)

    def worker(wid, *extra):
        return shoal("worker", "--redis-url", url, "--worker-id", wid, "--dtype", "float32",
                     "--kv-cache-bytes", str(64 << 20), "--threads", "1", *extra,
                     env=worker_env(1))

    tp_worker = worker("tp", "--tensor-parallel-size", "3")
    procs = [shoal("scheduler", "--redis-url", url), shoal("gateway", "--redis-url", url,
                                                            "--port", str(gport)), tp_worker]
    try:
        wait_ready(base, procs + [redis_proc], timeout_s=240)
        fleet = httpx.get(base + "/v1/fleet").json()["workers"]
        assert [w["worker_id"] for w in fleet] == ["tp"]
        body = {"prompt": tp_probe.PROMPTS[0], "max_tokens": tp_probe.MAX_TOKENS,
                "temperature": 0, "ignore_eos": True}
        served = httpx.post(base + "/v1/completions", json=body, timeout=120).json()
        expected_text = served["choices"][0]["text"]
        assert served["usage"]["completion_tokens"] == tp_probe.MAX_TOKENS

        # A long stream starts on the tensor-parallel worker (the only one); a plain worker
        # joins; then one rank of the tensor-parallel worker is killed mid-stream.
        procs.append(worker("single"))
        long_body = {**body, "max_tokens": 120, "stream": True}
        text, deaths = "", []
        with httpx.stream("POST", base + "/v1/completions", json=long_body, timeout=300) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                text += json.loads(line[6:])["choices"][0]["text"]
                if not deaths and len(text) > 40:
                    while len({w["worker_id"] for w in httpx.get(base + "/v1/fleet").json()
                               ["workers"]}) < 2:
                        time.sleep(0.5)  # the plain worker is up: somewhere to migrate to
                    victim = _follower_pids(tp_worker.pid)[0]
                    os.kill(victim, 9)
                    deaths.append(time.monotonic())
        assert deaths, "the stream ended before a rank could be killed"
        assert tp_worker.wait(30) == 1  # the worker failed cleanly, with status 1
        workers = [w["worker_id"] for w in httpx.get(base + "/v1/fleet").json()["workers"]]
        assert workers == ["single"]
        # Nothing lost or repeated: the migrated stream equals an unbroken greedy run.
        whole = httpx.post(base + "/v1/completions", json={**long_body, "stream": False},
                           timeout=300).json()["choices"][0]["text"]
        assert text == whole and text.startswith(expected_text)
    finally:
        stop_all(procs)
        stop_all([redis_proc])
