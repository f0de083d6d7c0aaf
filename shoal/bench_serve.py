"""`shoal bench serve`: a workload through a running gateway, over the OpenAI API with streaming.

Every request is sent as token ids to `/v1/completions` with `stream: true`, `ignore_eos` and
greedy sampling, so the output lengths are forced exactly as in `shoal bench engine`. Per request
it records TTFT (time to first token), ITL (gaps between tokens) and E2E latency, in seconds.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from shoal.workloads import W64, W64_QUICK, BenchRequest, make_requests


@dataclass
class RequestTiming:
    request_id: str
    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    error: str | None = None


async def _one(client: httpx.AsyncClient, url: str, model: str | None, r: BenchRequest,
               t_start: float) -> RequestTiming:
    timing = RequestTiming(r.request_id, len(r.prompt_token_ids))
    body = {"prompt": r.prompt_token_ids, "max_tokens": r.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    last = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            timing.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
            return timing
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if chunk.get("usage"):
                timing.output_tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and (chunk["choices"][0].get("text")
                                         or chunk["choices"][0].get("finish_reason")):
                if timing.ttft_s is None:
                    timing.ttft_s = now - t_start
                elif last is not None:
                    timing.itl_s.append(now - last)
                last = now
    timing.e2e_s = time.perf_counter() - t_start
    return timing


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def run_serve_bench(url: str, quick: bool, seed: int, vocab_size: int,
                          model: str | None = None) -> dict:
    """All requests at once (the W64 arrival pattern); returns the figures."""
    workload = W64_QUICK if quick else W64
    reqs = make_requests(workload, vocab_size, seed)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as client:
        # Warm-up: a few requests so no first-call cost lands in the figures.
        warm = make_requests(W64_QUICK, vocab_size, seed + 1, "warm")
        await asyncio.gather(*(_one(client, url, model, r, time.perf_counter()) for r in warm))
        t0 = time.perf_counter()
        timings = await asyncio.gather(*(_one(client, url, model, r, t0) for r in reqs))
        elapsed = time.perf_counter() - t0
    errors = [t for t in timings if t.error]
    ok = [t for t in timings if not t.error]
    generated = sum(t.output_tokens for t in ok)
    ttft = [t.ttft_s for t in ok if t.ttft_s is not None]
    itl = [x for t in ok for x in t.itl_s]
    return {
        "workload": workload.name, "seed": seed, "url": url, "requests": len(reqs),
        "errors": len(errors), "first_error": errors[0].error if errors else None,
        "generated_tokens": generated, "seconds": elapsed,
        "generated_tokens_per_s": generated / elapsed, "requests_per_s": len(ok) / elapsed,
        "ttft_s": {"p50": _pct(ttft, 0.5), "p90": _pct(ttft, 0.9), "p99": _pct(ttft, 0.99)},
        "itl_s": {"p50": _pct(itl, 0.5), "p90": _pct(itl, 0.9), "p99": _pct(itl, 0.99)},
        "median_e2e_s": statistics.median([t.e2e_s for t in ok]) if ok else float("nan"),
        "per_request": [asdict(t) for t in timings],
    }


def print_and_write(figures: dict, output: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"shoal bench serve ({figures['workload']}, {figures['url']})")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("generated tokens/s", f"{figures['generated_tokens_per_s']:.1f}")
    table.add_row("requests/s", f"{figures['requests_per_s']:.2f}")
    for k in ("p50", "p90", "p99"):
        table.add_row(f"TTFT {k} (ms)", f"{figures['ttft_s'][k] * 1e3:.1f}")
    for k in ("p50", "p90", "p99"):
        table.add_row(f"ITL {k} (ms)", f"{figures['itl_s'][k] * 1e3:.1f}")
    table.add_row("median E2E (s)", f"{figures['median_e2e_s']:.2f}")
    table.add_row("errors", str(figures["errors"]))
    console.print(table)
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=2))
    console.print(f"figures written to {out}")
