"""The scheduler process: Redis I/O around the policy in scheduler/core.py.

One loop: read new requests from the stream (consumer group), drain cancels, refresh the worker
registry (a worker whose heartbeat key expired is dead: its requests go back to the pool), place
waiting requests, keep one plan queued ahead of each busy worker so its engine never waits on Redis,
and turn iteration results into token events published to each request's gateway. A request's
stream entry is acknowledged (XACK) only when it has finished.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time

import redis

from scheduler import metrics
from scheduler.core import RequestState, Scheduler
from shoal.keys import Keys
from shoal.messages import (
    Cancel,
    IterationResult,
    RequestSubmission,
    TokenEvent,
    WorkerInfo,
    decode,
    encode,
)

log = logging.getLogger("shoal.scheduler")

PLANS_AHEAD = 2  # plans in flight per worker: the one running and one queued behind it
REGISTRY_REFRESH_S = 0.25


class SchedulerServer:
    def __init__(self, redis_url: str, policy: str = "reserve", max_num_seqs: int = 256,
                 prefix: str = "shoal", max_migrations: int = 3) -> None:
        self.redis = redis.Redis.from_url(redis_url)
        self.keys = Keys(prefix)
        self.core = Scheduler(policy, max_num_seqs, max_migrations)
        self.consumer = f"scheduler-{os.getpid()}"
        self.entry_ids: dict[str, bytes] = {}
        self._stop = False
        self._last_refresh = 0.0
        self._published_waiting = -1
        self._reply_to: dict[str, str] = {}  # request id -> its gateway channel, while in the pool

    def stop(self, *_: object) -> None:
        self._stop = True

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        try:
            self.redis.xgroup_create(self.keys.requests, self.keys.scheduler_group, id="0",
                                     mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        log.info("scheduler %s up (policy %s)", self.consumer, self.core.policy)
        while not self._stop:
            self.tick()
        return 0

    def tick(self) -> None:
        busy = any(w.plans_in_flight for w in self.core.workers.values())
        self._read_requests(block_ms=None if busy else 20)
        self._read_cancels()
        if time.monotonic() - self._last_refresh > REGISTRY_REFRESH_S:
            self._refresh_workers()
        now = time.time()
        for s in self.core.place():
            if s.admitted_at is None:
                s.admitted_at = now
                metrics.QUEUE_TIME.observe(max(0.0, now - s.sub.arrival_time))
        if self.core.failed:
            failed, self.core.failed = self.core.failed, []
            for e in failed:
                metrics.REQUESTS_FINISHED.labels("error").inc()
            self._publish(failed)
        self._send_plans()
        running = sum(len(w.running) for w in self.core.workers.values())
        metrics.REQUESTS_RUNNING.set(running)
        metrics.REQUESTS_WAITING.set(len(self.core.waiting))
        if len(self.core.waiting) != self._published_waiting:
            self._published_waiting = len(self.core.waiting)
            self.redis.set(self.keys.waiting, self._published_waiting)
        if busy:
            item = self.redis.blpop([self.keys.results], timeout=0.02)
            while item is not None:
                self._on_result(decode(item[1]))
                raw = self.redis.lpop(self.keys.results)
                item = (None, raw) if raw is not None else None

    def _read_requests(self, block_ms: int | None) -> None:
        resp = self.redis.xreadgroup(self.keys.scheduler_group, self.consumer,
                                     {self.keys.requests: ">"}, count=256, block=block_ms)
        for _stream, entries in resp or []:
            for entry_id, fields in entries:
                sub = decode(fields[b"m"])
                assert isinstance(sub, RequestSubmission)
                self.entry_ids[sub.request_id] = entry_id
                self._reply_to[sub.request_id] = sub.reply_to
                self.core.add_request(sub)

    def _read_cancels(self) -> None:
        raws = self.redis.lpop(self.keys.cancels, 256)
        for raw in raws or []:
            msg = decode(raw)
            assert isinstance(msg, Cancel)
            event = self.core.cancel(msg.request_id)
            if event is not None:
                metrics.REQUESTS_FINISHED.labels("cancelled").inc()
                self._publish([event])

    def _refresh_workers(self) -> None:
        self._last_refresh = time.monotonic()
        ids = [i.decode() for i in self.redis.smembers(self.keys.workers)]
        pipe = self.redis.pipeline(transaction=False)
        for wid in ids:
            pipe.exists(self.keys.alive(wid))
            pipe.hget(self.keys.worker(wid), "info")
        replies = pipe.execute()
        seen = set()
        for wid, alive, raw in zip(ids, replies[::2], replies[1::2]):
            if alive and raw:
                info = decode(raw)
                assert isinstance(info, WorkerInfo)
                known = self.core.workers.get(wid)
                if known is not None:  # keep the fresher free-block count from results
                    info = WorkerInfo(**{**info.to_dict(), "num_free_blocks": known.info.num_free_blocks})
                self.core.update_worker(info)
                seen.add(wid)
        metrics.WORKERS_ALIVE.set(len(seen))
        for wid, w in self.core.workers.items():
            metrics.KV_BLOCKS_FREE.labels(wid).set(w.info.num_free_blocks)
            metrics.KV_BLOCKS_TOTAL.labels(wid).set(w.info.num_total_blocks)
        for wid in list(self.core.workers):
            if wid not in seen:
                metrics.KV_BLOCKS_FREE.remove(wid)
                metrics.KV_BLOCKS_TOTAL.remove(wid)
                lost = len(self.core.workers[wid].running)
                failed = self.core.remove_worker(wid)
                log.warning("worker %s gone; %d requests back to the pool, %d failed", wid,
                            lost - len(failed), len(failed))
                for e in failed:
                    metrics.REQUESTS_FINISHED.labels("error").inc()
                self._publish(failed)
                # Its plans will never be read; a worker restarted under the same id starts clean.
                self.redis.srem(self.keys.workers, wid)
                self.redis.delete(self.keys.plans(wid))

    def _send_plans(self) -> None:
        for wid, w in self.core.workers.items():
            if w.plans_in_flight < PLANS_AHEAD and self.core.has_work(wid):
                t0 = time.perf_counter()
                plan = self.core.schedule(wid)
                metrics.SCHEDULING_SECONDS.observe(time.perf_counter() - t0)
                self.redis.rpush(self.keys.plans(wid), encode(plan))
                w.plans_in_flight += 1

    def _on_result(self, result: IterationResult) -> None:
        w = self.core.workers.get(result.worker_id)
        if w is not None:
            w.plans_in_flight = max(0, w.plans_in_flight - 1)
        if result.num_requests:
            metrics.BATCH_SIZE.observe(result.num_requests)
            metrics.ITERATION_TOKENS.observe(result.num_prefill_tokens + result.num_decode_tokens)
        states: dict[str, RequestState] = {}
        for out in result.outputs:
            s = self.core.requests.get(out.request_id)
            if s is not None:
                states[out.request_id] = s
            if out.finish_reason == "preempted":
                metrics.PREEMPTIONS.inc()
        events = self.core.postprocess(result)
        now = time.time()
        for e in events:
            s = states.get(e.request_id)
            if s is not None and e.token_ids and s.first_token_at is None:
                s.first_token_at = now
            if s is not None and e.finish_reason is not None:
                metrics.REQUESTS_FINISHED.labels(e.finish_reason).inc()
                self._log_finished(s, e.finish_reason, result.worker_id, now)
        self._publish(events)

    @staticmethod
    def _log_finished(s: RequestState, reason: str, worker_id: str, now: float) -> None:
        """One JSON line per finished request; never the prompt, the output or a key."""
        arrival = s.sub.arrival_time

        def since(t: float | None) -> float | None:
            return None if t is None else round(t - arrival, 4)

        log.info(json.dumps({
            "event": "request_finished", "request_id": s.sub.request_id, "worker": worker_id,
            "prompt_tokens": len(s.sub.prompt_token_ids),
            "generated_tokens": len(s.output_token_ids), "queue_time_s": since(s.admitted_at),
            "ttft_s": since(s.first_token_at), "e2e_s": since(now), "finish_reason": reason,
        }))

    def _publish(self, events: list[TokenEvent]) -> None:
        """Send events to their gateways; acknowledge the stream entry of each finished request."""
        if not events:
            return
        pipe = self.redis.pipeline(transaction=False)
        for event in events:
            final = event.finish_reason is not None
            channel = (self._reply_to.pop if final else self._reply_to.get)(event.request_id, None)
            if channel is not None:
                pipe.publish(channel, encode(event))
            if final:
                entry = self.entry_ids.pop(event.request_id, None)
                if entry is not None:
                    pipe.xack(self.keys.requests, self.keys.scheduler_group, entry)
        pipe.execute()
