"""Faults on real processes: a worker killed mid-stream, the active scheduler killed with a
standby running. These tests kill parts of the fleet, so the module runs its own."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import threading
import time

import httpx
import pytest

from shoal.fleet import shoal_command
from tests.conftest import metric_sum, running_fleet, spawn_gateway, spawn_worker

ORPHAN_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def fleet():
    with running_fleet(scheduler_args=("--orphan-timeout", str(ORPHAN_TIMEOUT_S))) as f:
        yield f


def _shoal(*args, **kw):
    return subprocess.Popen([*shoal_command(), *args], **kw)


def test_worker_killed_mid_stream_costs_recomputation_not_tokens(fleet, oracle, tokenizer):
    """SIGKILL the worker that runs a streaming request: within the heartbeat expiry the request
    is prefilled again on the other worker with its tokens so far; the stream goes on with no
    token missing or repeated and the greedy text of an undisturbed run."""
    import redis

    from shoal.messages import decode

    r = redis.Redis.from_url(fleet["redis"])
    victim = spawn_worker(fleet, "w-victim", 512 << 20)
    try:
        prompt = "The history of the fishing fleet began"
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        # Long enough that the request still runs a heartbeat (1 s) after its 10th token at any
        # speed the worker reaches here (60 tokens once ended before the heartbeat showed it).
        n = 240
        expected = tokenizer.decode(oracle(ids, n), skip_special_tokens=True)
        import websockets.sync.client as wsc

        tokens, indexes = [], []
        with wsc.connect(fleet["url"].replace("http", "ws") + "/v1/stream") as ws:
            ws.send(json.dumps({"prompt": prompt, "max_tokens": n, "temperature": 0,
                                "ignore_eos": True}))
            while True:
                m = json.loads(ws.recv(timeout=120))
                if m["type"] == "token":
                    tokens.append(m)
                    indexes.append(m["index"])
                    if len(tokens) == 10:
                        # It is the one generating (its heartbeat, every second, says so).
                        deadline = time.monotonic() + 5
                        while decode(r.hget("shoal:worker:w-victim", "info")).num_running != 1:
                            assert time.monotonic() < deadline
                            time.sleep(0.05)
                        victim.kill()
                        killed_at = time.monotonic()
                    if len(tokens) == 59:
                        # Noticed within the heartbeat expiry (3 s), then prefilled again.
                        assert time.monotonic() - killed_at < 20
                else:
                    assert m["type"] == "done", m
                    break
        assert indexes == list(range(n))
        assert "".join(m["text"] for m in tokens) == expected
    finally:
        if victim.poll() is None:
            victim.kill()
        victim.wait()


def test_standby_scheduler_takes_over_mid_stream(fleet, oracle, tokenizer):
    """SIGKILL the active scheduler while a stream runs; the standby takes the lease when it
    lapses, claims the pending request, resets the worker and re-admits it with the tokens
    published so far. The client sees every index once and the undisturbed greedy text."""
    import redis
    import websockets.sync.client as wsc

    r = redis.Redis.from_url(fleet["redis"])
    active = fleet["procs"][0]
    assert r.get("shoal:scheduler:lease") is not None
    from shoal.fleet import free_port

    port = free_port()
    standby = _shoal("scheduler", "--redis-url", fleet["redis"], "--metrics-port", str(port),
                     "--orphan-timeout", str(ORPHAN_TIMEOUT_S))
    fleet["procs"].insert(1, standby)  # the session's teardown stops it; it stays active after
    time.sleep(1.0)
    prompt = "A queue of fishing boats waited at the harbour while"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    expected = tokenizer.decode(oracle(ids, 50), skip_special_tokens=True)
    tokens = []
    with wsc.connect(fleet["url"].replace("http", "ws") + "/v1/stream") as ws:
        ws.send(json.dumps({"prompt": prompt, "max_tokens": 50, "temperature": 0,
                            "ignore_eos": True}))
        while True:
            m = json.loads(ws.recv(timeout=120))
            if m["type"] != "token":
                assert m["type"] == "done", m
                break
            tokens.append(m)
            if len(tokens) == 8:
                active.kill()
                active.wait()
                fleet["procs"].remove(active)
                fleet["metrics"]["scheduler"] = f"http://127.0.0.1:{port}/metrics"  # for later tests
    assert [m["index"] for m in tokens] == list(range(50))
    assert "".join(m["text"] for m in tokens) == expected
    assert m["usage"]["completion_tokens"] == 50
    owner = r.get("shoal:scheduler:lease")
    assert owner is not None and owner.decode().endswith(f"-{standby.pid}")
    assert standby.poll() is None
    # The new scheduler serves new requests too.
    c = httpx.post(fleet["url"] + "/v1/completions", timeout=60,
                   json={"prompt": prompt, "max_tokens": 5, "temperature": 0})
    assert c.status_code == 200 and c.json()["usage"]["completion_tokens"] == 5


def test_redis_outage_gives_503_and_the_fleet_recovers_by_itself(fleet):
    from shoal.fleet import start_redis

    body = {"prompt": "After the storm", "max_tokens": 4, "temperature": 0}
    assert httpx.post(fleet["url"] + "/v1/completions", json=body, timeout=60).status_code == 200
    fleet["redis_proc"].terminate()
    fleet["redis_proc"].wait(10)
    try:
        r = httpx.post(fleet["url"] + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 503
        assert "Redis" in r.json()["error"]["message"]
        assert httpx.get(fleet["url"] + "/readyz", timeout=30).status_code == 503
        time.sleep(2)  # every part notices and backs off
    finally:
        fleet["redis_proc"] = start_redis(fleet["redis_port"])  # empty, as a restarted Redis is
    deadline = time.monotonic() + 60
    while httpx.get(fleet["url"] + "/readyz", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "the workers never registered again"
        time.sleep(0.5)
    r = httpx.post(fleet["url"] + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert all(p.poll() is None for p in fleet["procs"]), "a part died instead of reconnecting"


def test_shoal_chaos_short_run():
    """Workers killed and restarted under load, and the active scheduler killed once: every
    request completes, no token index is duplicated or missing, outputs equal the undisturbed
    run."""
    # Enough decoding to outlast two kill intervals (at 40 tokens a request the run once ended,
    # in 1.5 s, before the first kill), and two kills at most: with a kill every 1.5 s a
    # 17-second run once lost one request's worker 4 times, past --max-migrations.
    r = subprocess.run([*shoal_command(), "chaos", "--requests", "12", "--max-tokens", "120",
                        "--kill-interval", "1.0", "--max-kills", "2", "--kill-scheduler"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:]
    assert "PASS" in r.stdout
    kills = re.search(r"worker kills\s*│\s*(\d+)", r.stdout)
    assert kills and 1 <= int(kills.group(1)) <= 2, r.stdout


def _post_until_gone(url: str, body: dict) -> None:
    """A client waiting on a completion until its gateway dies."""
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(url + "/v1/completions", json=body, timeout=120)


def test_the_requests_of_a_gateway_that_died_are_cancelled(fleet):
    """A gateway killed mid-stream leaves its requests generating for nobody: once its token
    channel has had no listener for --orphan-timeout, the scheduler cancels them, acknowledges
    their stream entries and the worker's blocks come back."""
    import redis

    from shoal.fleet import stop_all

    scheduler = fleet["metrics"]["scheduler"]
    orphaned = metric_sum(scheduler, "shoal_requests_orphaned_total")
    total = metric_sum(scheduler, "shoal_kv_blocks_total")
    gateway, url = spawn_gateway(fleet)
    try:
        # 2,000 tokens: both fit the K/V reserved for them (the fleet reserves prompt + max_tokens).
        body = {"prompt": "Once upon a time", "max_tokens": 2000, "temperature": 0,
                "ignore_eos": True}
        clients = [threading.Thread(target=_post_until_gone, args=(url, body), daemon=True)
                   for _ in range(2)]
        for c in clients:
            c.start()
        deadline = time.monotonic() + 60
        while metric_sum(scheduler, "shoal_requests_running") < 2:  # both generating
            assert time.monotonic() < deadline, "the requests never ran"
            time.sleep(0.1)
        gateway.kill()
        gateway.wait(timeout=30)
        deadline = time.monotonic() + ORPHAN_TIMEOUT_S + 20
        while metric_sum(scheduler, "shoal_requests_orphaned_total") < orphaned + 2:
            assert time.monotonic() < deadline, "the orphans were never cancelled"
            time.sleep(0.2)
        while metric_sum(scheduler, "shoal_kv_blocks_free") < total:
            assert time.monotonic() < deadline, "their K/V blocks never came back"
            time.sleep(0.2)
        assert metric_sum(scheduler, "shoal_requests_running") == 0
        r = redis.Redis.from_url(fleet["redis"])
        assert r.xpending("shoal:requests", "schedulers")["pending"] == 0
    finally:
        stop_all([gateway])
