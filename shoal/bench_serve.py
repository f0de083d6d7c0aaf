"""`shoal bench serve`: a load generator for any OpenAI-compatible server with streaming.

Requests go to `/v1/completions` with `stream: true`, `ignore_eos` and greedy sampling, as token
ids (or text, for requests read from a file), so output lengths are forced as in `shoal bench
engine`. Per request it records, in seconds from the moment the request was sent: TTFT (first
token), ITL (gaps between later tokens as they arrive), E2E, and E2E divided by the number of
output tokens (the Orca paper's normalised latency, §6).

Arrivals: `all` at once, `poisson` at each rate of a list (requests/s; exponential gaps, seeded),
or a fixed `concurrency` (that many in flight, the next sent when one ends). A run per rate (or
concurrency) makes a sweep; it prints a table, writes a JSON file, and draws with matplotlib
throughput against median normalised latency across the sweep (with the sweeps of `--compare`
files beside it), and the TTFT and ITL distributions.

The client is aiohttp on uvloop's event loop: the load generator shares the machine with the
fleet it measures, and its CPU is the fleet's loss. Per W64 run httpx took 0.41 CPU-seconds to
read the 64 streams, aiohttp (whose HTTP parser is C) 0.15, and aiohttp on uvloop 0.077 against
0.102 on asyncio's own loop (2-core Zen 5, 6 runs in turns; docs/benchmarks.md, session 30).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
import uuid
from collections.abc import Coroutine
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from shoal.figures import write_figures
from shoal.workloads import (
    ORCA,
    W64,
    W64_QUICK,
    BenchRequest,
    Workload,
    make_requests,
    read_requests,
)

T = TypeVar("T")

WORKLOADS = {"w64": W64, "orca": ORCA}
ARRIVALS = ("all", "poisson", "concurrency")


@dataclass
class RequestTiming:
    """One request's measurements, in seconds from the moment it was sent."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    sent_at_s: float = 0.0  # since the run's start
    output_tokens: int = 0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    error: str | None = None

    @property
    def normalized_latency_s(self) -> float | None:
        """E2E per output token (Orca §6: latency normalised by the output length)."""
        if self.e2e_s is None or not self.output_tokens:
            return None
        return self.e2e_s / self.output_tokens


def workload_requests(spec: str, vocab_size: int, seed: int, num_requests: int | None = None,
                      quick: bool = False) -> tuple[str, list[BenchRequest]]:
    """The requests of `spec`: "w64", "orca" or a JSONL file. Returns (name, requests).

    Raises:
        ValueError: an unknown workload or a bad file.
    """
    if spec.lower() in WORKLOADS:
        w = W64_QUICK if quick else WORKLOADS[spec.lower()]
        if num_requests:
            w = Workload(w.name, num_requests, w.prompt_len, w.output_len)
        return w.name, make_requests(w, vocab_size, seed)
    if not Path(spec).is_file():
        raise ValueError(f"workload must be w64, orca or a JSONL file; {spec!r} is none")
    reqs = read_requests(spec)
    return Path(spec).name, reqs[:num_requests] if num_requests else reqs


def run_client(coro: Coroutine[Any, Any, T]) -> T:
    """Run the load generator's coroutine to its end on uvloop's event loop (asyncio's own where
    uvloop is not installed: Windows)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


async def send_one(client: aiohttp.ClientSession, url: str, model: str | None, r: BenchRequest,
                   run_start: float, cache_salt: str | None = None) -> RequestTiming:
    """Send one streaming request (with `cache_salt` when given) and time it."""
    timing = RequestTiming(r.request_id, len(r.prompt_token_ids), r.max_tokens)
    body = {"prompt": r.prompt_text if r.prompt_text is not None else r.prompt_token_ids,
            "max_tokens": r.max_tokens, "temperature": r.temperature, "top_p": r.top_p,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    if r.seed is not None:
        body["seed"] = r.seed
    if model:
        body["model"] = model
    t0 = time.perf_counter()
    timing.sent_at_s = t0 - run_start
    last = None
    try:
        async with client.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                timing.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return timing
            async for raw in resp.content:  # one SSE line at a time
                line = raw.decode().rstrip("\r\n")
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("error"):
                    timing.error = str(chunk["error"].get("message"))
                    return timing
                if chunk.get("usage"):
                    timing.output_tokens = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices") or []
                if choices and (choices[0].get("text") or choices[0].get("finish_reason")):
                    if timing.ttft_s is None:
                        timing.ttft_s = now - t0
                    elif last is not None:
                        timing.itl_s.append(now - last)
                    last = now
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        timing.error = f"{type(e).__name__}: {e}"
        return timing
    timing.e2e_s = time.perf_counter() - t0
    return timing


async def run_once(client: aiohttp.ClientSession, url: str, model: str | None,
                   reqs: list[BenchRequest], arrival: str, rate: float | None,
                   concurrency: int | None, seed: int, on_done=None,
                   salted: bool = True) -> tuple[list[RequestTiming], float]:
    """One run of the workload under one arrival pattern; returns the timings and its length
    in seconds (first send to last answer). With `salted`, the run's requests carry a
    `cache_salt` of its own, so that they find nothing an earlier run left in the server's
    prefix cache: every run of a sweep computes the same prompts."""
    start = time.perf_counter()
    salt = f"bench-{uuid.uuid4().hex}" if salted else None

    async def timed(r: BenchRequest) -> RequestTiming:
        t = await send_one(client, url, model, r, start, salt)
        if on_done:
            on_done()
        return t

    if arrival == "concurrency":
        queue = list(reqs)
        results: list[RequestTiming] = []

        async def lane():
            while queue:
                results.append(await timed(queue.pop(0)))
        await asyncio.gather(*(lane() for _ in range(max(1, concurrency or 1))))
        return results, time.perf_counter() - start
    delays = [0.0] * len(reqs)
    if arrival == "poisson":
        rng = random.Random(seed)
        t = 0.0
        for i in range(len(reqs)):
            delays[i] = t
            t += rng.expovariate(rate)

    async def at(delay: float, r: BenchRequest) -> RequestTiming:
        await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
        return await timed(r)
    results = await asyncio.gather(*(at(d, r) for d, r in zip(delays, reqs)))
    return list(results), time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of `values`; NaN when empty."""
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(timings: list[RequestTiming], seconds: float) -> dict:
    """Throughput and latency figures of one run."""
    ok = [t for t in timings if not t.error]
    generated = sum(t.output_tokens for t in ok)
    ttft = [t.ttft_s for t in ok if t.ttft_s is not None]
    itl = [x for t in ok for x in t.itl_s]
    norm = [t.normalized_latency_s for t in ok if t.normalized_latency_s is not None]
    errors = [t for t in timings if t.error]
    return {
        "requests": len(timings), "errors": len(errors),
        "first_error": errors[0].error if errors else None,
        "generated_tokens": generated, "seconds": seconds,
        "generated_tokens_per_s": generated / seconds if seconds else float("nan"),
        "requests_per_s": len(ok) / seconds if seconds else float("nan"),
        "ttft_s": {q: pct(ttft, v) for q, v in (("p50", .5), ("p90", .9), ("p99", .99))},
        "itl_s": {q: pct(itl, v) for q, v in (("p50", .5), ("p90", .9), ("p99", .99))},
        "median_e2e_s": statistics.median([t.e2e_s for t in ok]) if ok else float("nan"),
        "normalized_latency_s": {"median": statistics.median(norm) if norm else float("nan"),
                                 "mean": statistics.fmean(norm) if norm else float("nan")},
    }


async def run_sweep(url: str, reqs: list[BenchRequest], arrival: str, rates: list[float],
                    concurrencies: list[int], seed: int, model: str | None = None,
                    warmup: list[BenchRequest] | None = None, progress: bool = True,
                    salted: bool = True) -> list[dict]:
    """Every run of the sweep (one per rate or concurrency; one for `all`), in order; `salted`
    as in `run_once`."""
    points: list[tuple[float | None, int | None]]
    if arrival == "poisson":
        points = [(r, None) for r in rates]
    elif arrival == "concurrency":
        points = [(None, c) for c in concurrencies]
    else:
        points = [(None, None)]
    runs = []
    from rich.progress import Progress

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                     connector=aiohttp.TCPConnector(limit=1024)) as client:
        if warmup:
            salt = f"bench-{uuid.uuid4().hex}" if salted else None
            await asyncio.gather(*(send_one(client, url, model, r, time.perf_counter(), salt)
                                   for r in warmup))
        with Progress(disable=not progress, transient=True) as bar:
            task = bar.add_task("requests", total=len(points) * len(reqs))
            for rate, conc in points:
                timings, seconds = await run_once(client, url, model, reqs, arrival, rate, conc,
                                                  seed, lambda: bar.advance(task), salted)
                runs.append({"arrival": arrival, "rate": rate, "concurrency": conc,
                             **summarize(timings, seconds),
                             "per_request": [{**asdict(t), "normalized_latency_s":
                                              t.normalized_latency_s} for t in timings]})
    return runs


def print_table(figures: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"shoal bench serve ({figures['workload']}, {figures['url']}"
                        f"{', ' + figures['label'] if figures.get('label') else ''})")
    for col in ("arrival", "req/s sent", "gen tok/s", "req/s", "TTFT p50/p99 (ms)",
                "ITL p50/p99 (ms)", "median E2E (s)", "median latency/token (ms)", "errors"):
        table.add_column(col, justify="right")
    for run in figures["runs"]:
        point = (f"poisson {run['rate']:g}" if run["arrival"] == "poisson" else
                 f"concurrency {run['concurrency']}" if run["arrival"] == "concurrency" else "all")
        table.add_row(point, f"{len(run['per_request']) / run['seconds']:.2f}",
                      f"{run['generated_tokens_per_s']:.1f}", f"{run['requests_per_s']:.2f}",
                      f"{run['ttft_s']['p50'] * 1e3:.0f} / {run['ttft_s']['p99'] * 1e3:.0f}",
                      f"{run['itl_s']['p50'] * 1e3:.0f} / {run['itl_s']['p99'] * 1e3:.0f}",
                      f"{run['median_e2e_s']:.2f}",
                      f"{run['normalized_latency_s']['median'] * 1e3:.1f}", str(run["errors"]))
    Console().print(table)


def write_outputs(figures: dict, output: str, compare: list[str] = ()) -> list[Path]:
    """Write the JSON file and the PNG plots beside it; returns the files written.

    Raises:
        OSError, ValueError: a `compare` file cannot be read.
    """
    out = write_figures(figures, output)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stem = out.with_suffix("")
    sweeps = [figures] + [json.loads(Path(c).read_text()) for c in compare]
    written = [out]

    fig, ax = plt.subplots(figsize=(6, 4))
    for f in sweeps:
        xs = [r["generated_tokens_per_s"] for r in f["runs"]]
        ys = [r["normalized_latency_s"]["median"] * 1e3 for r in f["runs"]]
        ax.plot(xs, ys, marker="o", label=f.get("label") or f["url"])
    ax.set_xlabel("throughput (generated tokens/s)")
    ax.set_ylabel("median latency per output token (ms)")
    ax.set_title(f"{figures['workload']}: throughput against normalised latency")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(f"{stem}-throughput-latency.png")
    fig.savefig(path, dpi=120)
    written.append(path)
    plt.close(fig)

    for key, label in (("ttft_s", "TTFT"), ("itl_s", "ITL")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for run in figures["runs"]:
            vals = sorted(x for t in run["per_request"] if not t["error"]
                          for x in ([t[key]] if key == "ttft_s" else t[key]) if x is not None)
            if vals:
                ax.plot([v * 1e3 for v in vals], [(i + 1) / len(vals) for i in range(len(vals))],
                        label=f"{run['arrival']} {run['rate'] or run['concurrency'] or ''}".strip())
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.set_title(f"{label} distribution (CDF)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = Path(f"{stem}-{label.lower()}.png")
        fig.savefig(path, dpi=120)
        written.append(path)
        plt.close(fig)
    return written
