"""The worker process: runs the iteration plans the scheduler addresses to it.

It registers (a hash plus a heartbeat key with a TTL), then loops: take the next plan, run one
engine iteration, hand over the result. Redis stays off that loop: one thread pops plans from the
worker's list while the engine computes (the scheduler keeps one queued ahead), another pushes
results. Waiting on those round trips at each iteration's end cost 0.4-5 ms (2 on average) per
iteration on two cores, where Redis, the scheduler and the gateway all wake at that moment. A
thread renews the heartbeat every second with the current free K/V blocks. On SIGTERM it drains:
it advertises `draining`, hands back any request it is asked to admit, finishes what it runs,
deregisters and exits 0.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import threading
import time
import uuid
from dataclasses import dataclass

import redis

from shoal.keys import Keys
from shoal.messages import IterationPlan, IterationResult, TokenOutput, WorkerInfo, decode, encode
from shoal.model_files import model_id
from worker import metrics
from worker.engine import Engine, KVCacheFullError

log = logging.getLogger("shoal.worker")


@dataclass
class WorkerSettings:
    redis_url: str
    worker_id: str = ""
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = 3.0
    prefix: str = "shoal"


class WorkerServer:
    """Connects one engine to the fleet through Redis."""

    def __init__(self, engine: Engine, model_path, settings: WorkerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.worker_id = settings.worker_id or f"worker-{uuid.uuid4().hex[:8]}"
        self.model = model_id(model_path)
        self.keys = Keys(settings.prefix)
        self.redis = redis.Redis.from_url(settings.redis_url)
        self._draining = threading.Event()
        self._stopped = threading.Event()
        self._plans: queue.Queue[IterationPlan] = queue.Queue()
        self._results: queue.Queue[IterationResult | None] = queue.Queue()
        self.incarnation = uuid.uuid4().hex[:12]
        self._totals = metrics.EngineTotals()

    def info(self) -> WorkerInfo:
        e = self.engine
        return WorkerInfo(self.worker_id, self.model, e.num_total_blocks, e.num_free_blocks,
                          e.block_size, e.cfg.max_num_seqs, e.max_model_len, len(e.running),
                          self._draining.is_set(), self.incarnation, time.time(),
                          e.cfg.max_num_batched_tokens, e.cfg.enable_prefix_caching)

    def _heartbeat(self, r: redis.Redis) -> None:
        info = encode(self.info())
        pipe = r.pipeline(transaction=False)
        pipe.hset(self.keys.worker(self.worker_id), "info", info)
        pipe.set(self.keys.alive(self.worker_id), b"1", px=int(self.settings.heartbeat_ttl_s * 1000))
        pipe.sadd(self.keys.workers, self.worker_id)
        pipe.execute()

    def _heartbeat_loop(self) -> None:
        r = redis.Redis.from_url(self.settings.redis_url)
        while not self._stopped.wait(self.settings.heartbeat_interval_s):
            try:
                self._heartbeat(r)
            except redis.RedisError as e:
                log.warning("heartbeat failed: %s", e)

    def _deregister(self) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.srem(self.keys.workers, self.worker_id)
        pipe.delete(self.keys.worker(self.worker_id), self.keys.alive(self.worker_id),
                    self.keys.plans(self.worker_id))
        pipe.execute()

    def fail(self, reason: str) -> None:
        """Leave the fleet at once and end the process with status 1: the engine cannot serve
        any more (a tensor-parallel rank died). Deregistering makes the scheduler notice now,
        not when the heartbeat expires, and move this worker's requests elsewhere."""
        log.error("worker %s failed: %s; leaving the fleet", self.worker_id, reason)
        self._stopped.set()
        with contextlib.suppress(redis.RedisError):
            self._deregister()
        logging.shutdown()
        os._exit(1)  # from any thread: the main one may be blocked in a collective

    def drain(self, *_: object) -> None:
        """Stop taking new requests; the loop exits once the running ones are done."""
        self._draining.set()

    def _read_plans(self) -> None:
        """Pop this worker's plans into `_plans` as they arrive, until stopped."""
        r = redis.Redis.from_url(self.settings.redis_url)
        backoff = 0.1
        while not self._stopped.is_set():
            try:
                item = r.blpop([self.keys.plans(self.worker_id)], timeout=0.5)
                backoff = 0.1
            except (redis.ConnectionError, redis.TimeoutError) as e:
                # The heartbeat thread re-registers once Redis is back; a scheduler that
                # takes over then resets this engine.
                log.warning("Redis unavailable (%s); retrying in %.1f s", e, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            if item is not None:
                plan = decode(item[1])
                assert isinstance(plan, IterationPlan)
                self._plans.put(plan)

    def _push_results(self) -> None:
        """Push each result of `_results` to the scheduler, in order, until a None."""
        r = redis.Redis.from_url(self.settings.redis_url)
        while (result := self._results.get()) is not None:
            try:
                r.rpush(self.keys.results, encode(result))
            except (redis.ConnectionError, redis.TimeoutError) as e:
                # Lost with the connection, as the plans in flight are: a scheduler that takes
                # over resets this engine and admits its requests again.
                log.warning("Redis unavailable (%s); iteration %d's result is lost", e,
                            result.iteration)

    def _or_fail(self, loop) -> None:
        """Run a thread's loop; if it breaks, the worker leaves the fleet rather than hang with
        its heartbeat still beating (an unreadable plan, say)."""
        try:
            loop()
        except Exception as e:
            self.fail(f"{loop.__name__}: {e!r}")

    def run(self) -> int:
        """Serve until drained. Returns the process exit status."""
        signal.signal(signal.SIGTERM, self.drain)
        signal.signal(signal.SIGINT, self.drain)
        self._heartbeat(self.redis)
        threading.Thread(target=self._heartbeat_loop, daemon=True).start()
        reader = threading.Thread(target=self._or_fail, args=(self._read_plans,), daemon=True)
        pusher = threading.Thread(target=self._or_fail, args=(self._push_results,), daemon=True)
        reader.start()
        pusher.start()
        levels, projections, level_rows = self.engine.model.levels_served()
        stack_rows = self.engine.model.stack_max_rows  # 0 where decode_stack does not serve
        log.info("worker %s serving %s with %d K/V blocks; %d of %d projections read the file's "
                 "4-bit levels in iterations of up to %d rows; %s", self.worker_id, self.model,
                 self.engine.num_total_blocks, levels, projections, level_rows,
                 f"all layers in one call up to {stack_rows} rows" if stack_rows
                 else "layers called one op at a time")
        try:
            while not (self._draining.is_set() and not self.engine.running):
                try:
                    plan = self._plans.get(timeout=0.5)
                except queue.Empty:
                    continue
                self._results.put(self.step(plan))
        finally:
            self._results.put(None)
            pusher.join()  # the last results reach the scheduler before we leave
            self._stopped.set()
            with contextlib.suppress(redis.RedisError):
                self._heartbeat(self.redis)  # last word: draining, with what is left
                self._deregister()
            reader.join()
        return 0

    def step(self, plan: IterationPlan) -> IterationResult:
        """One iteration; admissions while draining and requests preempted for lack of K/V blocks
        are handed back with `finish_reason="preempted"` for the scheduler to place again."""
        handed_back: list[TokenOutput] = []
        if self._draining.is_set() and plan.admit:
            handed_back += [TokenOutput(a.request_id, None, len(a.output_token_ids),
                                        finish_reason="preempted") for a in plan.admit]
            plan = IterationPlan(plan.iteration, [], plan.run, plan.release, plan.reset)
        while True:
            try:
                result = self.engine.step(plan)
                break
            except KVCacheFullError:
                # Preempt the newest request (recompute later), as vLLM does; admissions and
                # releases of the plan already took effect.
                victim = list(self.engine.running)[-1]
                seq = self.engine.running[victim]
                handed_back.append(TokenOutput(victim, None, seq.num_output_tokens,
                                               finish_reason="preempted"))
                self.engine.release(victim)
                plan = IterationPlan(plan.iteration, [], None, [])
        metrics.observe_iteration(result.num_prefill_tokens, result.num_decode_tokens,
                                  result.step_seconds, self.engine.num_free_blocks,
                                  self.engine.num_total_blocks)
        self._totals.observe(self.engine)
        return IterationResult(self.worker_id, result.iteration, handed_back + result.outputs,
                               self.engine.num_free_blocks, result.num_prefill_tokens,
                               result.num_decode_tokens, result.step_seconds, result.num_requests,
                               result.num_pending_prefill_tokens)


def default_worker_id() -> str:
    return f"{os.uname().nodename}-{os.getpid()}"


def wait_for_redis(url: str, timeout_s: float = 30.0) -> None:
    """Block until Redis answers PING.

    Raises:
        ConnectionError: it did not answer within `timeout_s` seconds.
    """
    r = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            r.ping()
            return
        except redis.ConnectionError as e:
            if time.monotonic() > deadline:
                raise ConnectionError(f"Redis at {url} did not answer: {e}") from e
            time.sleep(0.2)
