"""Shared fixtures: the real default model (loaded once per test process: the suite runs in two,
pyproject.toml) and tiny random models."""

from __future__ import annotations

import contextlib
import os

# Two busy processes on two cores make OpenMP spin; tests never need more than that.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Triton reads this when it is imported: without a GPU its interpreter runs the kernels of
# worker/kernels on CPU tensors (tests/test_kernels.py). Nothing imports Triton before this line.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from shoal.model_files import default_model_path, load_tokenizer, load_transformers_model
from worker.config import EngineConfig, ModelConfig
from worker.engine import Engine
from worker.loader import load_model


@pytest.fixture(scope="session")
def model_path():
    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(model_path):
    return load_tokenizer(model_path)


@pytest.fixture(scope="session")
def fp32_model(model_path):
    """(ModelConfig, weights) of SmolLM2 in float32."""
    return load_model(model_path, torch.float32)


@pytest.fixture(scope="session")
def hf_model(model_path):
    """transformers' own model from the same GGUF: the oracle."""
    return load_transformers_model(model_path, torch.float32)


def spawn_gateway(fleet: dict):
    """Start one more gateway process on `fleet`'s Redis; returns (process, its base URL) once
    it is ready.

    Raises:
        RuntimeError: it exited or was not ready within 120 s.
    """
    import subprocess

    from shoal.fleet import free_port, shoal_command, wait_ready

    port = free_port()
    proc = subprocess.Popen([*shoal_command(), "gateway", "--redis-url", fleet["redis"],
                             "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, [proc], timeout_s=120)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, url


def metric_sum(url: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples on a /metrics page whose labels include `labels` (0 when
    there are none)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url, timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.name == name and labels.items() <= s.labels.items())


def finished_requests(log_path) -> dict[str, dict]:
    """The scheduler's log line per finished request (scheduler/server.py `_log_finished`) in a
    log file, by request id."""
    import json

    out = {}
    for line in log_path.read_text().splitlines():
        if '"event": "request_finished"' in line:
            entry = json.loads(line[line.index("{"):])
            out[entry["request_id"]] = entry
    return out


@pytest.fixture
def redis_url():
    """A redis-server of its own on a free port, for one test."""
    from shoal.fleet import free_port, start_redis, stop_all

    proc = start_redis(port := free_port())
    yield f"redis://127.0.0.1:{port}/0"
    stop_all([proc])


@contextlib.contextmanager
def running_fleet(worker_args: tuple[str, ...] = (), scheduler_log=None,
                  gateway_args: tuple[str, ...] = (), scheduler_args: tuple[str, ...] = ()):
    """A real fleet: redis-server, scheduler, one float32 worker "w0" (256 MiB of K/V: 364
    blocks, plus `worker_args`) and the gateway, each a process, with metrics exported. The
    scheduler's log (one JSON line per finished request) goes to the file `scheduler_log` if
    given; `gateway_args` and `scheduler_args` are added to those parts' command lines."""
    import subprocess

    from shoal.fleet import free_ports, shoal_command, start_redis, stop_all, wait_ready, worker_env

    rport, gport, sport, wport = free_ports(4)
    redis_proc = start_redis(rport)
    url = f"redis://127.0.0.1:{rport}/0"

    def shoal(*args, **kw):
        return subprocess.Popen([*shoal_command(), *args], **kw)

    log = open(scheduler_log, "w") if scheduler_log else None  # closed in `finally` below
    procs = [
        shoal("scheduler", "--redis-url", url, "--metrics-port", str(sport), *scheduler_args,
              stderr=log),
        shoal("worker", "--redis-url", url, "--worker-id", "w0", "--dtype", "float32",
              "--kv-cache-bytes", str(256 << 20), "--threads", "1", "--metrics-port", str(wport),
              *worker_args, env=worker_env(1)),
        shoal("gateway", "--redis-url", url, "--port", str(gport), *gateway_args),
    ]
    base = f"http://127.0.0.1:{gport}"
    fleet = {"url": base, "redis": url, "procs": procs, "redis_proc": redis_proc,
             "redis_port": rport,
             "metrics": {"gateway": f"{base}/metrics",
                         "scheduler": f"http://127.0.0.1:{sport}/metrics",
                         "worker": f"http://127.0.0.1:{wport}/metrics"}}
    try:
        wait_ready(base, procs + [redis_proc], timeout_s=180)
        yield fleet
    finally:
        stop_all(procs)  # the fleet first, Redis last (a test may have restarted it)
        stop_all([fleet["redis_proc"]])
        if log:
            log.close()


def spawn_worker(fleet: dict, worker_id: str, kv_cache_bytes: int, *args: str):
    """Start one more float32 worker in `fleet` (with extra command-line `args`) and return once
    the scheduler can know it.

    Raises:
        AssertionError: it did not register within 120 s, or exited.
    """
    import subprocess
    import time

    import redis

    from shoal.fleet import shoal_command, worker_env

    proc = subprocess.Popen(
        [*shoal_command(), "worker", "--redis-url", fleet["redis"], "--worker-id",
         worker_id, "--dtype", "float32", "--kv-cache-bytes", str(kv_cache_bytes), "--threads",
         "1", *args], env=worker_env(1))
    r = redis.Redis.from_url(fleet["redis"])
    deadline = time.monotonic() + 120
    while not r.sismember("shoal:workers", worker_id):
        assert time.monotonic() < deadline and proc.poll() is None, f"{worker_id} never registered"
        time.sleep(0.2)
    time.sleep(1.0)  # the scheduler reads the registry every 0.25 s
    return proc


@contextlib.contextmanager
def extra_gateway(fleet: dict, *args: str):
    """A second gateway process in front of `fleet`, with extra command-line `args`; yields its
    base URL."""
    import subprocess

    from shoal.fleet import free_port, shoal_command, stop_all, wait_ready

    port = free_port()
    proc = subprocess.Popen([*shoal_command(), "gateway", "--redis-url", fleet["redis"],
                             "--port", str(port), *args])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, [proc], timeout_s=120)
        yield url
    finally:
        stop_all([proc])


@pytest.fixture(scope="session")
def fleet():
    """The fleet most tests share. Tests that kill its parts use their own (test_failover.py)."""
    with running_fleet() as f:
        yield f


@pytest.fixture(scope="session")
def oracle(fp32_model):
    """Greedy tokens from the in-process float32 engine for the same prompt ids (and any other
    sampling parameters given)."""
    from shoal.messages import NewRequest
    from shoal.sampling_params import SamplingParams
    from worker.offline import generate

    engine = make_engine(fp32_model)

    def run(ids, max_tokens, **params):
        params = SamplingParams(**{"max_tokens": max_tokens, "temperature": 0.0, **params})
        out = generate(engine, [NewRequest("o", ids, params)])
        return out["o"].token_ids
    return run


def make_engine(model, **kw) -> Engine:
    """An engine of `model` (config, weights); on the CPU unless `device` says otherwise (on a
    machine with a GPU the engine's own default would be CUDA). `model_path` gives it the
    model's tokenizer (structured outputs)."""
    cfg, weights = model
    keep = kw.pop("keep_logits", False)
    path = kw.pop("model_path", None)
    kw.setdefault("kv_cache_bytes", 256 << 20)
    kw.setdefault("dtype", torch.float32)
    kw.setdefault("device", "cpu")
    return Engine(cfg, weights, EngineConfig(**kw), keep_logits=keep, model_path=path)


def tiny_config(**kw) -> ModelConfig:
    """A small random Llama for shape and bookkeeping tests (never a stand-in for the real one)."""
    base = dict(vocab_size=128, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=6,
                num_kv_heads=2, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-5,
                max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=1)
    base.update(kw)
    return ModelConfig(**base)


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.1):
        return torch.randn(*shape, generator=g) * scale

    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    w = {"model.embed_tokens.weight": r(cfg.vocab_size, h, scale=1.0),
         "model.norm.weight": 1 + r(h), "lm_head.weight": r(cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": 1 + r(h), p + "post_attention_layernorm.weight": 1 + r(h),
              p + "self_attn.q_proj.weight": r(q, h), p + "self_attn.k_proj.weight": r(kv, h),
              p + "self_attn.v_proj.weight": r(kv, h), p + "self_attn.o_proj.weight": r(h, q),
              p + "mlp.gate_proj.weight": r(inter, h), p + "mlp.up_proj.weight": r(inter, h),
              p + "mlp.down_proj.weight": r(h, inter)}
    return w


def random_q4_levels(out_features: int, in_features: int, g: torch.Generator,
                      q4_0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Random GGUF 4-bit levels `[out, in]` and float16 scales and minimums `[out, in / 32, 2]`:
    Q4_1's (d > 0, any m) or Q4_0's (d of either sign, m = -8 d)."""
    levels = torch.randint(0, 16, (out_features, in_features), generator=g, dtype=torch.uint8)
    d = torch.rand(out_features, in_features // 32, generator=g) * 0.02 + 1e-4
    if q4_0:
        d = (d * torch.randn(d.shape, generator=g).sign()).half()
        m = d * -8
    else:
        d, m = d.half(), (torch.randn(d.shape, generator=g) * 0.1).half()
    return levels, torch.stack([d, m], dim=-1)


def tiny_engine(num_blocks: int, block_size: int = 4, cfg: ModelConfig | None = None,
                **kw) -> Engine:
    """A float32 engine over the tiny random model (`tiny_config()`, or `cfg`; `random_weights`)
    with room for exactly `num_blocks` K/V blocks of `block_size` tokens; `kw` are more
    EngineConfig fields."""
    from worker.kv_cache import bytes_per_block

    cfg = cfg or tiny_config()
    kv_bytes = num_blocks * bytes_per_block(cfg, block_size, torch.float32)
    return Engine(cfg, random_weights(cfg), EngineConfig(dtype=torch.float32, block_size=block_size,
                                                         kv_cache_bytes=kv_bytes, **kw))
