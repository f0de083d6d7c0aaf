"""`shoal bench fleet`: a workload through a whole fleet against the same engine in-process, in
turns.

Issue 13 measures the fleet's cost as W64 through `shoal up` (`shoal bench serve`) over W64
in-process (`shoal bench engine`). On a shared 2-core host either figure moves by 10-40% within
minutes (docs/benchmarks.md), so two commands run minutes apart compare phases of the host as
much as the two paths: sessions 27 and 28 scripted pairs by hand to see anything. This command
holds both sides: it loads the engine in its own process, as `shoal bench engine` does (its
environment is this process's), starts a fleet as `shoal up` does (`start_fleet`: Redis,
scheduler, one worker with the same engine flags and `worker_env`'s OpenMP settings, gateway),
warms each on other prompts of the workload, then runs the workload `rounds` times through each,
in turns, the order alternating from round to round. The share is the median of the rounds'
fleet / in-process ratios, each taken within seconds.

The in-process side is `worker.bench.run_workload` (all requests submitted at t = 0, the prefix
cache emptied first); the fleet side is `shoal bench serve`'s client (`run_sweep`: the requests
sent at once, streamed, with a cache salt of their own). Both generate exactly the workload's
`max_tokens` per request (EOS ignored), greedy, from the same token ids. This process's CPU time
during a fleet run is the load generator's (the engine here is idle then).

Each side also reports its iterations that computed tokens and their seconds (`engine_seconds`:
in-process from the engine's totals, in the fleet from the worker's `shoal_engine_step_seconds`
histogram), so a share below 1 splits into iterations that ran slower or more of them (other
processes on the worker's cores, a different batching) and time outside them (the worker's loop,
Redis, the scheduler, the gateway, the client); and the same of the decode-only iterations (the
histogram's "decode" series), during which the gateway and the client handle the tokens the
iteration before streamed out; the rest are the iterations with prompts.
"""

from __future__ import annotations

import contextlib
import json
import resource
import socket
import statistics
import time
import urllib.request
from pathlib import Path

import psutil
from prometheus_client.parser import text_string_to_metric_families

from shoal.bench_serve import run_client, run_sweep
from shoal.fleet import Fleet, free_port, start_fleet
from shoal.workloads import W64, W64_QUICK, BenchRequest, make_requests
from worker.bench import run_workload, to_engine_requests
from worker.engine import Engine


def _engine_totals(metrics_url: str) -> dict[str, float]:
    """The iterations a worker has run and their seconds, in every phase (`iterations`,
    `engine_seconds`) and decode-only (`decode_iterations`, `decode_engine_seconds`), from its
    `shoal_engine_step_seconds` histogram at `metrics_url`."""
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    totals = dict.fromkeys(("iterations", "engine_seconds", "decode_iterations",
                            "decode_engine_seconds"), 0.0)
    for family in text_string_to_metric_families(text):
        if family.name == "shoal_engine_step_seconds":
            for sample in family.samples:
                kind = ("iterations" if sample.name.endswith("_count")
                        else "engine_seconds" if sample.name.endswith("_sum") else None)
                if kind is not None:
                    totals[kind] += sample.value
                    if sample.labels.get("phase") == "decode":
                        totals[f"decode_{kind}"] += sample.value
    return totals


def _metrics_port_base() -> int:
    """A port p with p and p + 1 free: the fleet's scheduler and its worker serve /metrics
    there (start_fleet's numbering)."""
    while True:
        base = free_port()
        with contextlib.suppress(OSError), socket.socket() as s:
            s.bind(("127.0.0.1", base + 1))
            return base


def _fleet_counters(procs: dict[str, psutil.Process], metrics_url: str) -> dict[str, float]:
    """The CPU seconds each of `procs` has spent, and the worker's iterations and their seconds
    (`_engine_totals`' keys), now.

    Raises:
        RuntimeError: a fleet process has gone (its CPU time or the worker's metrics unreadable).
    """
    try:
        counters = {name: sum(p.cpu_times()[:2]) for name, p in procs.items()}
        counters.update(_engine_totals(metrics_url))
    except (psutil.Error, OSError) as e:
        raise RuntimeError(f"the fleet stopped answering: {e}") from e
    return counters


def _fleet_run(fleet: Fleet, metrics_url: str, reqs: list[BenchRequest], seed: int) -> dict:
    """One run of `reqs` through the fleet's gateway, with the CPU seconds each process spent
    and the worker's iterations and their seconds.

    Raises:
        RuntimeError: a request failed (the fleet's figure would not be the workload's), or a
            fleet process has gone.
    """
    parts = {"scheduler": fleet.scheduler, "worker": fleet.workers[0], "gateway": fleet.gateway,
             **({"redis": fleet.redis} if fleet.redis else {})}
    procs = {name: psutil.Process(p.pid) for name, p in parts.items()}
    before = _fleet_counters(procs, metrics_url)
    client0 = time.process_time()
    run = run_client(run_sweep(fleet.url, reqs, "all", [], [], seed, progress=False))[0]
    client = time.process_time() - client0
    if run["errors"]:
        raise RuntimeError(f"{run['errors']} of {run['requests']} requests through the fleet "
                           f"failed; first error: {run['first_error']}")
    after = _fleet_counters(procs, metrics_url)
    spent = {name: after[name] - before[name] for name in after}
    return {"generated_tokens": run["generated_tokens"], "seconds": run["seconds"],
            "generated_tokens_per_s": run["generated_tokens_per_s"],
            "iterations": int(spent.pop("iterations")),
            "engine_seconds": spent.pop("engine_seconds"),
            "decode_iterations": int(spent.pop("decode_iterations")),
            "decode_engine_seconds": spent.pop("decode_engine_seconds"),
            "cpu_seconds": {**spent, "load generator": client}}


def _peak_rss_bytes(pid: int) -> int | None:
    """The peak resident set of process `pid` (Linux's VmHWM), or None where /proc lacks it."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run_fleet_bench(engine: Engine, worker_args: list[str], threads: int | None, rounds: int,
                    quick: bool, seed: int, output: str, stream_interval: int = 1) -> dict:
    """Run the workload (W64, or W64-quick with `quick`) `rounds` times in-process on `engine`
    and through a fleet whose worker runs with `worker_args` (the engine's flags) and `threads`
    and whose scheduler streams `stream_interval` tokens an event, in turns; print a table and
    write the figures as JSON to `output`.

    Returns the figures: each round's tokens/s on both sides and their ratio, the medians, the
    median ratio (`fleet_share`), CPU seconds per fleet process per run (medians) and the peak
    resident memory of the fleet's worker and of this process (bytes).

    Raises:
        RuntimeError: the fleet did not start (its logs are in `output`'s .log beside it), or a
            request through it failed.
        FileNotFoundError: no redis-server to start.
    """
    from rich.console import Console
    from rich.table import Table

    console = Console()
    workload = W64_QUICK if quick else W64
    vocab = engine.model_cfg.vocab_size
    reqs = make_requests(workload, vocab, seed)
    warm = make_requests(workload, vocab, seed + 1, "warm")
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_path = out.with_suffix(".log")  # the fleet's logs: one line per request is too many here
    with console.status("starting a fleet (Redis, scheduler, one worker, gateway)"), \
            open(log_path, "w") as log:
        metrics_base = _metrics_port_base()
        fleet = start_fleet("127.0.0.1", free_port(), 1, None, worker_args, threads,
                            metrics_port_base=metrics_base, log=log,
                            scheduler_args=["--stream-interval", str(stream_interval)])
    metrics_url = f"http://127.0.0.1:{metrics_base + 1}/metrics"
    try:
        with console.status("warming up both"):
            run_workload(engine, to_engine_requests(warm))
            _fleet_run(fleet, metrics_url, warm, seed + 1)
        results = []
        for i in range(rounds):
            order = ("engine", "fleet") if i % 2 == 0 else ("fleet", "engine")
            r: dict = {"order": list(order)}
            for side in order:
                with console.status(f"round {i + 1} of {rounds}: {workload.name} "
                                    f"{'in-process' if side == 'engine' else 'through the fleet'}"):
                    r[side] = (run_workload(engine, to_engine_requests(reqs)) if side == "engine"
                               else _fleet_run(fleet, metrics_url, reqs, seed))
            r["fleet_share"] = (r["fleet"]["generated_tokens_per_s"]
                                / r["engine"]["generated_tokens_per_s"])
            results.append(r)
        worker_rss = _peak_rss_bytes(fleet.workers[0].pid)
    finally:
        fleet.stop()

    def median(side: str) -> float:
        return statistics.median(r[side]["generated_tokens_per_s"] for r in results)

    def median_of(side: str, key: str) -> float:
        return statistics.median(r[side][key] for r in results)

    cpu_parts = results[0]["fleet"]["cpu_seconds"].keys()
    figures = {
        "workload": workload.name, "seed": seed, "stream_interval": stream_interval,
        "rounds": results,
        "engine_tokens_per_s": median("engine"), "fleet_tokens_per_s": median("fleet"),
        "iterations": {side: median_of(side, "iterations") for side in ("engine", "fleet")},
        "engine_seconds": {side: median_of(side, "engine_seconds") for side in ("engine", "fleet")},
        "decode_iterations": {side: median_of(side, "decode_iterations")
                              for side in ("engine", "fleet")},
        "decode_engine_seconds": {side: median_of(side, "decode_engine_seconds")
                                  for side in ("engine", "fleet")},
        "seconds": {side: median_of(side, "seconds") for side in ("engine", "fleet")},
        "fleet_share": statistics.median(r["fleet_share"] for r in results),
        "fleet_cpu_seconds_per_run": {
            p: statistics.median(r["fleet"]["cpu_seconds"][p] for r in results) for p in cpu_parts},
        "worker_peak_rss_bytes": worker_rss,
        "engine_process_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }

    interval = "" if stream_interval == 1 else f", --stream-interval {stream_interval}"
    table = Table(title=f"shoal bench fleet ({workload.name}{interval}, generated tokens/s)")
    for col in ("round", "in-process", "fleet", "fleet / in-process"):
        table.add_column(col, justify="right")
    for i, r in enumerate(results):
        table.add_row(f"{i + 1} ({r['order'][0]} first)",
                      f"{r['engine']['generated_tokens_per_s']:.1f}",
                      f"{r['fleet']['generated_tokens_per_s']:.1f}", f"{r['fleet_share']:.3f}")
    table.add_row("median", f"{figures['engine_tokens_per_s']:.1f}",
                  f"{figures['fleet_tokens_per_s']:.1f}", f"{figures['fleet_share']:.3f}")
    console.print(table)
    console.print("per run (medians), in-process / fleet: iterations {0:g} / {1:g}; seconds in "
                  "them {2:.2f} / {3:.2f}; wall seconds {4:.2f} / {5:.2f}".format(
                      *figures["iterations"].values(), *figures["engine_seconds"].values(),
                      *figures["seconds"].values()))
    console.print("... of them decode-only: {0:g} / {1:g}; seconds in them {2:.2f} / {3:.2f}".format(
        *figures["decode_iterations"].values(), *figures["decode_engine_seconds"].values()))
    console.print("CPU seconds per fleet run (medians): " + ", ".join(
        f"{p} {s:.2f}" for p, s in figures["fleet_cpu_seconds_per_run"].items()))
    if worker_rss is not None:
        console.print(f"fleet worker peak RSS {worker_rss / 2**20:,.0f} MiB; this process "
                      f"(engine and load generator) {figures['engine_process_peak_rss_bytes'] / 2**20:,.0f} MiB")
    out.write_text(json.dumps(figures, indent=2))
    console.print(f"wrote {out} (the fleet's logs: {log_path})")
    return figures
