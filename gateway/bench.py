"""`shoal bench gateway`: the gateway's CPU per streamed token, with no engine behind it.

Issue 13 asks W64 through the fleet for 95% of the engine's in-process figure. On a 2-core host
the processes beside the worker take that share: each CPU-second they spend mid-iteration holds
back both of the worker's threads (docs/benchmarks.md, sessions 13, 30 and 45), and the gateway
spends the most of them (2-core Zen 5, session 52: gateway 0.15, load generator 0.08, scheduler
0.07 and Redis 0.03 CPU-seconds a W64 run). Through a whole fleet that cost moves with the
engine's speed and with the host's noise, so this benchmark holds the gateway alone: a real
gateway and Redis (`shoal.fleet`), W64's requests from `shoal bench serve`'s client, and in
place of the scheduler and the workers a stand-in process (`run_stand_in`) that answers every
request with one token each `token_interval_s`, up to its `max_tokens`, published as the
scheduler publishes them (one `TokenEvents` message per gateway per tick, the last event with
the usage). W64's decode iterations took 15 ms on average on that Zen 5, hence the default.

Each run reports the CPU-seconds of the gateway, the stand-in, Redis and the client, and the
gateway's and the client's per streamed token (admission included: a request's HTTP request,
tokenizing nothing, since W64 sends token ids, and its enqueueing). CPU time is read from each
thread's `schedstat` (nanoseconds) where Linux has it: psutil's clock ticks of 10 ms are 7% of a
run's gateway time.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

import psutil
import redis

from shoal.bench_serve import run_client, run_sweep
from shoal.figures import write_figures
from shoal.fleet import free_port, shoal_command, start_redis, stop_all, wait_ready
from shoal.keys import Keys
from shoal.messages import RequestSubmission, TokenEvent, TokenEvents, decode, encode
from shoal.workloads import W64, W64_QUICK, make_requests


def run_stand_in(redis_url: str, token_interval_s: float, keys: Keys = Keys()) -> None:
    """The scheduler's part as the gateway sees it, until killed: read requests from the stream
    (as the scheduler's consumer group does), and every `token_interval_s` publish one token to
    each request held, the last (its `max_tokens`-th) with `finish_reason="length"` and the
    usage. The tokens are the request's prompt ids in turn, so the gateway detokenizes real
    vocabulary."""
    r = redis.Redis.from_url(redis_url)
    try:
        r.xgroup_create(keys.requests, keys.scheduler_group, id="0", mkstream=True)
    except redis.ResponseError:  # BUSYGROUP: a stand-in before this one made it
        pass
    held: dict[str, tuple[RequestSubmission, list[int]]] = {}  # id -> (request, [tokens sent])
    next_tick = time.perf_counter()
    while True:
        # Sleep to the tick and read without blocking: Redis times blocked commands out on its
        # cron (10 times a second), so an XREADGROUP blocking for 16 ms returned after ~90.
        time.sleep(max(0.0, next_tick - time.perf_counter()))
        next_tick = max(next_tick + token_interval_s, time.perf_counter())
        for _, entries in r.xreadgroup(keys.scheduler_group, "bench-stand-in",
                                       {keys.requests: ">"}, count=1024) or []:
            for entry, fields in entries:
                sub = decode(fields[b"m"])
                if isinstance(sub, RequestSubmission):
                    held[sub.request_id] = (sub, [0])
            r.xack(keys.requests, keys.scheduler_group, *(entry for entry, _ in entries))
        by_channel: dict[str, list[TokenEvent]] = {}
        for rid, (sub, sent) in list(held.items()):
            i, ids = sent[0], sub.prompt_token_ids
            last = i + 1 >= sub.params.max_tokens
            by_channel.setdefault(sub.reply_to, []).append(TokenEvent(
                rid, i, [ids[i % len(ids)]], finish_reason="length" if last else None,
                prompt_tokens=len(ids) if last else 0, completion_tokens=i + 1 if last else 0))
            sent[0] += 1
            if last:
                del held[rid]
        if by_channel:
            pipe = r.pipeline(transaction=False)
            for channel, events in by_channel.items():
                pipe.publish(channel, encode(TokenEvents(events)))
            pipe.execute()


def _cpu_seconds(pid: int) -> float:
    """CPU-seconds process `pid` has spent, its threads' together: from each thread's
    `/proc/<pid>/task/<tid>/schedstat` (nanoseconds) on Linux, else psutil (clock ticks).

    Raises:
        psutil.NoSuchProcess: the process is gone.
    """
    tasks = f"/proc/{pid}/task"
    if not os.path.isdir(tasks):
        return sum(psutil.Process(pid).cpu_times()[:2])
    total = 0
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            pass
    return total / 1e9


def run_gateway_bench(rounds: int, token_interval_s: float, output: str, quick: bool = False,
                      seed: int = 0, model: str | None = None, vocab_size: int = 49152) -> dict:
    """Start Redis, a gateway (`--model model`, else the default) and the stand-in; warm up on
    other prompts of the workload, then run W64 (W64-quick with `quick`) `rounds` times. Prints
    a table and writes the figures as JSON to `output`; returns them.

    Raises:
        RuntimeError: a process did not start or exited, or a request failed.
    """
    from rich.console import Console
    from rich.table import Table

    workload = W64_QUICK if quick else W64
    reqs = make_requests(workload, vocab_size, seed)
    warmup = make_requests(workload, vocab_size, seed + 1, "warm")
    redis_port, port = free_port(), free_port()
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    url = f"http://127.0.0.1:{port}"
    procs: dict[str, subprocess.Popen] = {"redis": start_redis(redis_port)}
    console = Console()
    try:
        procs["stand-in"] = subprocess.Popen(
            [sys.executable, "-m", "gateway.bench", redis_url, str(token_interval_s)])
        procs["gateway"] = subprocess.Popen(shoal_command(
            "gateway", "--redis-url", redis_url, "--host", "127.0.0.1", "--port", str(port),
            *(["--model", model] if model else [])), stdout=subprocess.DEVNULL)
        # A completion of one token rather than /readyz, which wants an alive worker.
        probe = urllib.request.Request(
            f"{url}/v1/completions", json.dumps({"prompt": [1, 2, 3], "max_tokens": 1}).encode(),
            {"Content-Type": "application/json"})
        with console.status("starting a gateway"):
            wait_ready(url, list(procs.values()), 60, probe)
        with console.status("warming up"):
            _check(run_client(run_sweep(url, warmup, "all", [], [], seed, progress=False))[0])
        # No spinner while measuring: its thread's CPU would count as the client's.
        console.print(f"{rounds} runs of {workload.name} through the gateway")
        runs = [_measured_run(url, reqs, seed, procs) for _ in range(rounds)]
    finally:  # the gateway first: it would log Redis gone
        stop_all([procs.pop("gateway")] if "gateway" in procs else [])
        stop_all(list(procs.values()))
    per_token = {part: statistics.median(r["cpu_seconds"][part] / r["generated_tokens"]
                                         for r in runs) for part in ("gateway", "client")}
    figures = {"workload": workload.name, "seed": seed, "token_interval_s": token_interval_s,
               "model": model, "runs": runs,
               "gateway_cpu_us_per_token": per_token["gateway"] * 1e6,
               "client_cpu_us_per_token": per_token["client"] * 1e6}
    table = Table(title=f"shoal bench gateway ({workload.name}, a token every "
                        f"{token_interval_s * 1e3:g} ms from a scheduler stand-in; CPU-seconds "
                        "and CPU µs per token)")
    for col in ("run", "tokens", "s", "gateway", "client", "stand-in", "redis",
                "gateway µs/tok", "client µs/tok"):
        table.add_column(col, justify="right")
    for i, r in enumerate(runs, 1):
        cpu, n = r["cpu_seconds"], r["generated_tokens"]
        table.add_row(str(i), str(n), f"{r['seconds']:.2f}", f"{cpu['gateway']:.3f}",
                      f"{cpu['client']:.3f}", f"{cpu['stand-in']:.3f}", f"{cpu['redis']:.3f}",
                      f"{cpu['gateway'] / n * 1e6:.1f}", f"{cpu['client'] / n * 1e6:.1f}")
    table.add_row("median", "", "", "", "", "", "", f"{figures['gateway_cpu_us_per_token']:.1f}",
                  f"{figures['client_cpu_us_per_token']:.1f}")
    console.print(table)
    console.print(f"figures written to {write_figures(figures, output)}")
    return figures


def _check(run: dict) -> dict:
    """`run` (a `run_sweep` run), unless a request of it failed (RuntimeError)."""
    if run["errors"]:
        raise RuntimeError(f"{run['errors']} of {run['requests']} requests failed; first "
                           f"error: {run['first_error']}")
    return run


def _measured_run(url: str, reqs, seed: int, procs: dict[str, subprocess.Popen]) -> dict:
    """One run of `reqs` with each process's CPU-seconds (`client`: this process's)."""
    parts = ("gateway", "stand-in", "redis")
    before = {p: _cpu_seconds(procs[p].pid) for p in parts}
    client0 = time.process_time()
    run = _check(run_client(run_sweep(url, reqs, "all", [], [], seed, progress=False))[0])
    cpu = {p: _cpu_seconds(procs[p].pid) - before[p] for p in parts}
    cpu["client"] = time.process_time() - client0
    return {"generated_tokens": run["generated_tokens"], "seconds": run["seconds"],
            "cpu_seconds": cpu}


if __name__ == "__main__":  # the stand-in's process: python -m gateway.bench REDIS_URL INTERVAL_S
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    run_stand_in(sys.argv[1], float(sys.argv[2]))
