"""`shoal bench scheduler`: the scheduling policy alone, against simulated workers.

No Redis and no engine: each simulated worker turns a plan into a result with one token per
running request, and takes `a + b * tokens` seconds of virtual time per iteration (the timing
model). A discrete-event loop always serves the worker whose iteration ends first: the
scheduler consumes its result (`postprocess`), places waiting requests (`place`) and makes its
next plan (`schedule`). The wall time of those three calls is the cost of one plan, what this
benchmark measures, for fleets of 1 to 256 workers and pools of up to 10,000 requests.
"""

from __future__ import annotations

import heapq
import statistics
import time
from dataclasses import dataclass, field

from scheduler.core import Scheduler
from shoal.figures import write_figures
from shoal.messages import IterationResult, RequestSubmission, TokenOutput, WorkerInfo
from shoal.sampling_params import SamplingParams


@dataclass
class SimWorker:
    """A worker reduced to its timing model and the requests it runs."""

    worker_id: str
    num_total_blocks: int
    remaining: dict[str, int] = field(default_factory=dict)  # request -> tokens left
    emitted: dict[str, int] = field(default_factory=dict)  # request -> tokens sent
    iteration: int = 0

    def info(self) -> WorkerInfo:
        return WorkerInfo(self.worker_id, "m", self.num_total_blocks, self.num_total_blocks,
                          16, 256, 8192, len(self.remaining))

    def run(self, plan, prompt_len: int, a: float, b: float) -> tuple[IterationResult, float]:
        """One iteration: admitted requests prefill and sample, running ones decode one token.
        Returns the result and its duration in seconds under the timing model."""
        for rid in plan.release:
            self.remaining.pop(rid, None)
        tokens = 0
        for req in plan.admit:
            self.remaining[req.request_id] = req.params.max_tokens
            self.emitted[req.request_id] = 0
            tokens += prompt_len - 1
        outputs = []
        for rid in list(self.remaining):
            index = self.emitted[rid]
            self.emitted[rid] += 1
            self.remaining[rid] -= 1
            done = self.remaining[rid] == 0
            outputs.append(TokenOutput(rid, 7, index, None, "length" if done else None))
            if done:
                del self.remaining[rid], self.emitted[rid]
            tokens += 1
        self.iteration += 1
        result = IterationResult(self.worker_id, plan.iteration, outputs, self.num_total_blocks,
                                 num_decode_tokens=tokens, num_requests=len(outputs))
        return result, a + b * tokens


def simulate(num_workers: int, num_requests: int, max_plans: int = 3000, prompt_len: int = 128,
             max_tokens: int = 64, a: float = 0.005, b: float = 0.0002) -> dict:
    """Run the discrete-event loop until every request finished or `max_plans` plans were made.

    Returns figures: microseconds per plan (median, p99), plans per second of scheduler CPU,
    mean running and waiting requests, and the fleet's simulated generated tokens/s.
    """
    sched = Scheduler("reserve", max_num_seqs=256)
    workers = {f"w{i}": SimWorker(f"w{i}", 1_000_000) for i in range(num_workers)}
    for w in workers.values():
        sched.update_worker(w.info())
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(num_requests):
        sched.add_request(RequestSubmission(f"r{i}", "m", [5] * prompt_len, params, float(i) * 1e-6,
                                            "reply"))
    costs: list[float] = []
    running, waiting = [], []
    tokens = 0
    clock = 0.0
    # Every worker starts at t=0 with a first plan.
    t0 = time.perf_counter()
    sched.place(now=0.0)
    plans = {wid: sched.schedule(wid) for wid in workers}
    costs.append((time.perf_counter() - t0) / num_workers)
    heap = []
    for wid, w in workers.items():
        result, dt = w.run(plans[wid], prompt_len, a, b)
        heapq.heappush(heap, (dt, wid, result))
    while heap and len(costs) < max_plans:
        clock, wid, result = heapq.heappop(heap)
        tokens += len(result.outputs)
        t = time.perf_counter()
        sched.postprocess(result)
        sched.place(now=clock)
        plan = sched.schedule(wid)
        costs.append(time.perf_counter() - t)
        running.append(sum(len(w.running) for w in sched.workers.values()))
        waiting.append(len(sched.waiting))
        if plan.admit or workers[wid].remaining or plan.release:
            result, dt = workers[wid].run(plan, prompt_len, a, b)
            heapq.heappush(heap, (clock + dt, wid, result))
        elif sched.waiting or any(w.remaining for w in workers.values()):
            # Idle now: look again when the next busy worker reports.
            nxt = heap[0][0] if heap else clock + a
            idle = IterationResult(wid, plan.iteration, [], workers[wid].num_total_blocks)
            heapq.heappush(heap, (nxt + 1e-9, wid, idle))
    us = sorted(c * 1e6 for c in costs)
    return {
        "workers": num_workers, "requests": num_requests, "plans": len(costs),
        "us_per_plan_median": statistics.median(us), "us_per_plan_p99": us[int(0.99 * (len(us) - 1))],
        "plans_per_s": len(costs) / sum(costs),
        "mean_running": statistics.fmean(running) if running else 0.0,
        "mean_waiting": statistics.fmean(waiting) if waiting else 0.0,
        "simulated_tokens_per_s": tokens / clock if clock else float("nan"),
    }


def run_scheduler_bench(workers: list[int], requests: list[int], max_plans: int, output: str) -> list[dict]:
    """Every combination; prints a table and writes the figures as JSON to `output`."""
    from rich.console import Console
    from rich.table import Table

    rows = []
    console = Console()
    with console.status("simulating") as status:
        for n in requests:
            for w in workers:
                status.update(f"{w} workers, {n} requests")
                rows.append(simulate(w, n, max_plans))
    table = Table(title="shoal bench scheduler (simulated workers: step = 5 ms + 0.2 ms x tokens)")
    for col in ("workers", "requests", "mean running", "mean waiting", "µs per plan (median)",
                "µs per plan (p99)", "plans/s", "simulated tokens/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["workers"]), str(r["requests"]), f"{r['mean_running']:.0f}",
                      f"{r['mean_waiting']:.0f}", f"{r['us_per_plan_median']:.0f}",
                      f"{r['us_per_plan_p99']:.0f}", f"{r['plans_per_s']:.0f}",
                      f"{r['simulated_tokens_per_s']:.0f}")
    console.print(table)
    console.print(f"figures written to {write_figures(rows, output)}")
    return rows
