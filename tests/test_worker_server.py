"""The worker's link to the fleet (worker/server.py), in-process against a real redis-server."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import redis
import torch

from shoal.keys import Keys
from tests.conftest import random_weights, tiny_config
from worker.config import EngineConfig
from worker.engine import Engine
from worker.server import WorkerServer, WorkerSettings

CFG = tiny_config()


def test_a_worker_that_leaves_leaves_no_registration_behind(redis_url, monkeypatch):
    """The heartbeat thread may be inside a heartbeat when the main thread deregisters (a loaded
    host: a fleet test once saw it). Its write must not bring the worker back as a ghost that
    the gateway counts as ready until the heartbeat expires. Here that thread's heartbeats
    stall between reading Redis and writing to it until the worker has stopped, and 50 ms
    more: the main thread's last word lands inside the stall."""
    engine = Engine(CFG, random_weights(CFG), EngineConfig(dtype=torch.float32, block_size=4,
                                                           kv_cache_bytes=1 << 20))
    read_loras = WorkerServer._read_loras

    def slow_in_the_heartbeat_thread(self, r):
        read_loras(self, r)
        if threading.current_thread() is not threading.main_thread():
            self._stopped.wait(5)
            time.sleep(0.05)

    monkeypatch.setattr(WorkerServer, "_read_loras", slow_in_the_heartbeat_thread)
    r = redis.Redis.from_url(redis_url)
    keys = Keys("shoal")
    for round_ in range(3):
        wid = f"w{round_}"
        server = WorkerServer(engine, Path("m.gguf"), WorkerSettings(
            redis_url, worker_id=wid, heartbeat_interval_s=0.001, heartbeat_ttl_s=30.0))
        registered = threading.Event()

        def drain_once_registered(server=server, wid=wid, registered=registered):
            for _ in range(500):
                if r.exists(keys.alive(wid)):
                    registered.set()
                    break
                time.sleep(0.01)
            server.drain()

        helper = threading.Thread(target=drain_once_registered)
        helper.start()
        assert server.run() == 0  # in this thread: it installs signal handlers
        helper.join()
        assert registered.is_set(), "the worker never registered"
        time.sleep(0.2)  # the stalled heartbeat, if it is still to come, lands
        assert not r.sismember(keys.workers, wid), round_
        assert not r.exists(keys.alive(wid)) and not r.exists(keys.worker(wid)), round_
