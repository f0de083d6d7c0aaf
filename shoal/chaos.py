"""`shoal chaos`: requests through a fleet whose workers (and optionally scheduler) keep dying.

It starts its own fleet (embedded Redis, a scheduler, N workers, a gateway), runs the requests once
undisturbed, then again while a chaos thread SIGKILLs a random worker every `--kill-interval`
seconds (at most `--max-kills` times) and restarts it under the same id, and, with
`--kill-scheduler`, kills the active scheduler once while a standby runs. Every request streams
over the WebSocket, so each token arrives with its index: the run counts completed and failed
requests, duplicated and missing indexes, and whether each output equals the undisturbed run's.
Greedy float32 by default, so recomputation after a failover gives the same tokens.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import threading
import time
from dataclasses import dataclass, field

from shoal.fleet import (
    free_ports,
    shoal_command,
    start_redis,
    stop_all,
    wait_ready,
    worker_env,
)


@dataclass
class Outcome:
    tokens: dict[int, int] = field(default_factory=dict)  # index -> token id
    duplicates: int = 0
    error: str | None = None
    done: bool = False


async def _stream(url: str, prompt: str, max_tokens: int) -> Outcome:
    from websockets.asyncio.client import connect

    out = Outcome()
    async with connect(url.replace("http", "ws", 1) + "/v1/stream", open_timeout=30) as ws:
        await ws.send(json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                  "ignore_eos": True}))
        async for raw in ws:
            m = json.loads(raw)
            if m["type"] == "token":
                if m["index"] in out.tokens:
                    out.duplicates += 1
                out.tokens[m["index"]] = m["token_id"]
            elif m["type"] == "done":
                out.done = True
                break
            else:
                out.error = m.get("message", "error")
                break
    return out


async def _run_all(url: str, prompts: list[str], max_tokens: int) -> list[Outcome]:
    async def guarded(p: str) -> Outcome:
        try:
            return await asyncio.wait_for(_stream(url, p, max_tokens), timeout=600)
        except Exception as e:  # noqa: BLE001 - every failure is counted, none is fatal
            return Outcome(error=f"{type(e).__name__}: {e}")
    return await asyncio.gather(*(guarded(p) for p in prompts))


def run_chaos(num_requests: int, workers: int, max_tokens: int, kill_interval_s: float,
              restart_delay_s: float, kill_scheduler: bool, dtype: str, seed: int,
              max_kills: int = 0) -> dict:
    """Run the experiment; returns the counts (see the module docstring). `max_kills` (0: no
    limit) stops the worker kills after that many, so that how many a request can meet does
    not grow with the run's length (past --max-migrations it fails, as it should)."""
    rng = random.Random(seed)
    rport, gport = free_ports(2)
    redis_proc = start_redis(rport)
    redis_url = f"redis://127.0.0.1:{rport}/0"
    worker_args = ["--dtype", dtype, "--kv-cache-bytes", str(256 << 20), "--threads", "1"]

    def start_worker(i: int) -> subprocess.Popen:
        return subprocess.Popen(shoal_command("worker", "--redis-url", redis_url, "--worker-id",
                                       f"chaos-{i}", *worker_args), env=worker_env(1))

    schedulers = [subprocess.Popen(shoal_command("scheduler", "--redis-url", redis_url))]
    if kill_scheduler:
        schedulers.append(subprocess.Popen(shoal_command("scheduler", "--redis-url", redis_url)))
    pool = [start_worker(i) for i in range(workers)]
    gateway = subprocess.Popen(shoal_command("gateway", "--redis-url", redis_url, "--port", str(gport)))
    url = f"http://127.0.0.1:{gport}"
    prompts = [f"Report {i}: the fleet sailed at dawn and" for i in range(num_requests)]
    kills = {"workers": 0, "schedulers": 0}
    try:
        wait_ready(url, [redis_proc, gateway, *pool, *schedulers], timeout_s=300)
        time.sleep(1.0)  # every worker registered with the scheduler
        baseline = asyncio.run(_run_all(url, prompts, max_tokens))

        stop = threading.Event()

        def chaos() -> None:
            scheduler_killed = False
            while not stop.wait(kill_interval_s):
                i = rng.randrange(workers)
                pool[i].kill()
                pool[i].wait()
                kills["workers"] += 1
                if kill_scheduler and not scheduler_killed:
                    schedulers[0].kill()  # the first started holds the lease
                    schedulers[0].wait()
                    kills["schedulers"] += 1
                    scheduler_killed = True
                    schedulers.append(subprocess.Popen(shoal_command("scheduler", "--redis-url",
                                                              redis_url)))
                if stop.wait(restart_delay_s):
                    pool[i] = start_worker(i)
                    return
                pool[i] = start_worker(i)
                if kills["workers"] == max_kills:
                    return

        t = threading.Thread(target=chaos, daemon=True)
        t.start()
        t0 = time.monotonic()
        disturbed = asyncio.run(_run_all(url, prompts, max_tokens))
        elapsed = time.monotonic() - t0
        stop.set()
        t.join()
    finally:
        stop_all([gateway, *pool, *schedulers])
        stop_all([redis_proc])

    completed = sum(o.done for o in disturbed)
    failed = [o.error for o in disturbed if not o.done]
    missing = sum(max_tokens - len(o.tokens) for o in disturbed if o.done)
    duplicated = sum(o.duplicates for o in disturbed)
    equal = sum(o.done and b.done and o.tokens == b.tokens for o, b in zip(disturbed, baseline))
    return {"requests": num_requests, "workers": workers, "max_tokens": max_tokens,
            "worker_kills": kills["workers"], "scheduler_kills": kills["schedulers"],
            "completed": completed, "failed": len(failed), "first_failure": failed[0] if failed
            else None, "duplicated": duplicated, "missing": missing,
            "equal_to_undisturbed": equal, "seconds": round(elapsed, 1),
            "baseline_completed": sum(b.done for b in baseline)}


def passed(r: dict) -> bool:
    return (r["completed"] == r["requests"] == r["baseline_completed"] and r["duplicated"] == 0
            and r["missing"] == 0 and r["equal_to_undisturbed"] == r["requests"])
