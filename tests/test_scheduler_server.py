"""The scheduler process's Redis loop against a real redis-server and the real gateway code, with a
worker simulated by the test (it takes plans and never answers)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest
import redis

import scheduler.server as scheduler_server
from gateway.app import CompletionRequest, Gateway
from shoal.fleet import free_port, start_redis, stop_all
from shoal.keys import Keys
from shoal.messages import IterationPlan, WorkerInfo, decode, encode


@pytest.fixture
def redis_url():
    proc = start_redis(port := free_port())
    yield f"redis://127.0.0.1:{port}/0"
    stop_all([proc])


def test_the_scheduler_sleeps_until_a_request_or_a_cancel_rings(redis_url, monkeypatch):
    """With its timer pushed out to 10 minutes, the scheduler still admits a request the gateway
    submits while the only worker is busy, and drops it (acknowledging its stream entry) when
    the gateway cancels it: the gateway's wake-ups wake it, not polling."""
    monkeypatch.setattr(scheduler_server, "WAIT_S", 600.0)
    keys = Keys()
    r = redis.Redis.from_url(redis_url, socket_timeout=60)  # its BLPOPs wait longer than 5 s

    async def scenario() -> None:
        gw = Gateway(redis_url, None)
        await gw.start()
        info = WorkerInfo("w-sim", gw.model, 1000, 1000, 16, 256, 8192, 0, False, "inc-1",
                          time.time())
        r.sadd(keys.workers, "w-sim")
        r.hset(keys.worker("w-sim"), "info", encode(info))
        r.set(keys.alive("w-sim"), b"1", px=600_000)
        server = scheduler_server.SchedulerServer(redis_url, lease_ms=600_000)
        loop = threading.Thread(target=server.run, args=(False,), daemon=True)
        loop.start()
        try:
            # Taking over, the scheduler resets the worker; that plan stays unanswered, so the
            # worker counts as busy from here on.
            first = r.blpop([keys.plans("w-sim")], timeout=30)
            assert first is not None and decode(first[1]).reset
            time.sleep(0.3)  # the scheduler is now asleep in its BLPOP

            p = gw.prepare_completion(CompletionRequest(prompt="Hello", max_tokens=8))
            events = gw.run(p)
            waiter = asyncio.ensure_future(events.__anext__())  # submits, then waits for tokens
            item = await asyncio.to_thread(r.blpop, [keys.plans("w-sim")], 20)
            assert item is not None, "the scheduler did not wake for the new request"
            plan = decode(item[1])
            assert isinstance(plan, IterationPlan)
            assert [a.request_id for a in plan.admit] == [p.request_id]
            assert r.xpending(keys.requests, keys.scheduler_group)["pending"] == 1

            waiter.cancel()  # the client goes away: the gateway cancels the request
            with contextlib.suppress(asyncio.CancelledError):
                await waiter
            await events.aclose()
            deadline = time.monotonic() + 30
            while r.xpending(keys.requests, keys.scheduler_group)["pending"]:
                assert time.monotonic() < deadline, "the scheduler did not wake for the cancel"
                await asyncio.sleep(0.05)
            assert p.request_id not in server.core.requests
        finally:
            server.stop()
            r.rpush(keys.wakeups, b"1")  # let the loop see the stop
            loop.join(10)
            await gw.stop()
        assert not loop.is_alive()

    asyncio.run(scenario())
