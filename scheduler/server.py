"""The scheduler process: Redis I/O around the policy in scheduler/core.py.

Only the holder of the lease (SET NX PX, renewed every second) schedules; other scheduler
processes stand by and take over when it lapses: they claim the pending stream entries
(XAUTOCLAIM), read back each request's tokens so far, reset every worker, and admit the unfinished
requests again (recompute). Clients still connected keep receiving tokens; indexes let the gateway
drop the ones it already has.

One loop: read new requests from the stream (consumer group) and drain cancels once a wake-up
has announced them, refresh the worker registry (a worker whose heartbeat key expired is dead: its
requests go back to the pool), place waiting requests, keep one plan queued ahead of each busy
worker so its engine never waits on Redis (made as late as is safe behind a long prefill, so that
requests arriving meanwhile join it), and turn iteration results into token events published to
each request's gateway. A gateway that is gone (killed, or its host lost) leaves its requests
running for nobody: PUBLISH answers how many listened, and once a gateway's token channel has had
none for `orphan_timeout_s`, the requests it submitted are cancelled (orphans), the waiting ones
too. Between ticks it sleeps in one BLPOP on the results list and the wake-up
list the gateways ring after each request and cancel, sent in one pipeline after the tick's
writes. A request's stream entry is acknowledged (XACK) only when it has finished.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from scheduler import metrics
from scheduler.core import RequestState, Scheduler, WorkerState
from shoal import tracing
from shoal.keys import Keys
from shoal.messages import (
    Cancel,
    IterationPlan,
    IterationResult,
    RequestSubmission,
    TokenEvent,
    TokenEvents,
    WorkerInfo,
    decode,
    encode,
)

log = logging.getLogger("shoal.scheduler")

PLANS_AHEAD = 2  # plans in flight per worker: the one running and one queued behind it
# Seconds a gateway's token channel may go without a listener before its requests are cancelled:
# well past a live gateway's resubscription after a Redis blip (it backs off at most 2 s).
ORPHAN_TIMEOUT_S = 10.0
REGISTRY_REFRESH_S = 0.25
# The longest a tick sleeps waiting for a result or a wake-up: the lease, the registry and queue
# deadlines are looked at this often. Polling every 20 ms instead (what an earlier loop did while
# a worker was busy) cost a Redis round trip per wake, 400 a W64 run, each taking a core from
# the worker mid-iteration.
WAIT_S = REGISTRY_REFRESH_S
PROGRESS_TTL_S = 3600  # a request's saved tokens outlive any plausible failover
# The TTL is set with the first saved token and renewed every this many (not on each token: one
# command fewer per token), so a request generating for longer than the TTL keeps its tokens.
PROGRESS_TTL_REFRESH_TOKENS = 64

# Append each request's new tokens to its progress list, in one command for the whole iteration:
# 64 RPUSHes a decode iteration cost the scheduler 190 us of CPU to build and send, this 55.
# KEYS: the progress lists; ARGV: the TTL, then for each key the token count, whether to renew
# its TTL (1/0) and the tokens. Each call carries one iteration's tokens, a handful per key.
_APPEND_PROGRESS = """
local a = 2
for _, key in ipairs(KEYS) do
  local n = tonumber(ARGV[a])
  redis.call('RPUSH', key, unpack(ARGV, a + 2, a + 1 + n))
  if ARGV[a + 1] == '1' then redis.call('EXPIRE', key, ARGV[1]) end
  a = a + 2 + n
end
return 0
"""

# Renew the lease only if we still hold it (a plain PEXPIRE could extend a successor's lease).
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""


class _Alarm:
    """Rings the scheduler's wake-up list at a set time (monotonic seconds), from a thread of its
    own: a plan held behind a running prefill is due within milliseconds, and BLPOP's own
    timeout only fires on Redis's clock ticks (`hz` 10: up to 100 ms late, measured)."""

    def __init__(self, ring: Callable[[], object]) -> None:
        self._ring = ring
        self._at: float | None = None
        self._cv = threading.Condition()
        threading.Thread(target=self._loop, daemon=True, name="plan-alarm").start()

    def set(self, at: float) -> None:
        """Ring at `at` (or at the earlier time already set)."""
        with self._cv:
            if self._at is None or at < self._at:
                self._at = at
                self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._at is None or self._at > time.monotonic():
                    self._cv.wait(None if self._at is None else self._at - time.monotonic())
                self._at = None
            with contextlib.suppress(redis.RedisError):  # the tick's own timeout still comes
                self._ring()


class SchedulerServer:
    def __init__(self, redis_url: str, policy: str = "reserve", max_num_seqs: int = 256,
                 prefix: str = "shoal", max_migrations: int = 3, lease_ms: int = 3000,
                 queue_deadline_s: float = 0.0, priority_aging_s: float = 30.0,
                 tracer: Any = None, stream_interval: int = 1,
                 orphan_timeout_s: float = ORPHAN_TIMEOUT_S) -> None:
        self.redis = redis.Redis.from_url(redis_url)
        self.orphan_timeout_s = orphan_timeout_s
        self.tracer = tracer  # spans of requests whose gateway traces them (shoal/tracing.py)
        self.keys = Keys(prefix)
        self.core = Scheduler(policy, max_num_seqs, max_migrations, queue_deadline_s,
                              priority_aging_s, stream_interval)
        self.consumer = f"scheduler-{os.uname().nodename}-{os.getpid()}"
        self.lease_ms = lease_ms
        self._renew = self.redis.register_script(_RENEW)
        self._active = False
        self._lease_renewed_at = 0.0
        self.entry_ids: dict[str, bytes] = {}
        self._stop = False
        self._last_refresh = 0.0
        self._published_waiting = -1
        self._reply_to: dict[str, str] = {}  # request id -> its gateway channel, while in the pool
        # The outbox's PUBLISHes (their place in it, the channel), whose replies count listeners,
        # and each channel found without one, since when (monotonic seconds).
        self._published: list[tuple[int, str]] = []
        self._unheard: dict[str, float] = {}
        # Writes whose replies nobody waits for (token events, progress, acknowledgements): they
        # go out with the next tick's reads, in one round trip. Every command wakes Redis, which
        # on a small machine takes a core from the worker mid-iteration.
        self._outbox = self.redis.pipeline(transaction=False)
        self._results_key = self.keys.results.encode()
        self._exchange_due = True  # new requests or cancels may be waiting in Redis
        self._alarm = _Alarm(lambda: self.redis.rpush(self.keys.wakeups, b"1"))

    def stop(self, *_: object) -> None:
        self._stop = True

    def run(self, handle_signals: bool = True) -> int:
        """Schedule (or stand by) until stopped; SIGTERM and SIGINT stop it when
        `handle_signals` (only the main thread may install handlers). Returns the exit status."""
        if handle_signals:
            signal.signal(signal.SIGTERM, self.stop)
            signal.signal(signal.SIGINT, self.stop)
        log.info("scheduler %s up (policy %s), waiting for the lease", self.consumer,
                 self.core.policy)
        backoff = 0.1
        while not self._stop:
            try:
                if not self._hold_lease():
                    if self._active:
                        log.error("scheduler %s lost its lease; standing by", self.consumer)
                        self._step_down()
                    time.sleep(min(0.5, self.lease_ms / 4000))
                    continue
                if not self._active:
                    self._take_over()
                    self._active = True
                self.tick()
                backoff = 0.1
            except (redis.ConnectionError, redis.TimeoutError) as e:
                # Redis went away: what it held may be gone too, so start over as a standby.
                log.warning("Redis unavailable (%s); retrying in %.1f s", e, backoff)
                self._step_down()
                time.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
        if self._active:  # hand over at once rather than after the lease expires
            with contextlib.suppress(redis.RedisError):
                self._outbox.execute()
                self.redis.delete(self.keys.lease)
        return 0

    def _step_down(self) -> None:
        """Forget everything; a (re)takeover rebuilds it from Redis."""
        self._active = False
        c = self.core
        self.core = Scheduler(c.policy, c.max_num_seqs, c.max_migrations, c.queue_deadline_s,
                              c.priority_aging_s, c.stream_interval)
        self.entry_ids.clear()
        self._reply_to.clear()
        self._published.clear()
        self._unheard.clear()
        self._published_waiting = -1
        self._outbox.reset()  # a successor republishes from the progress lists
        self._exchange_due = True

    def _hold_lease(self) -> bool:
        """Acquire the lease, or renew it about three times per TTL. True while we hold it."""
        now = time.monotonic()
        if self._active and now - self._lease_renewed_at < self.lease_ms / 3000:
            return True
        if self._active:
            held = bool(self._renew(keys=[self.keys.lease], args=[self.consumer, self.lease_ms]))
        else:
            held = bool(self.redis.set(self.keys.lease, self.consumer, nx=True, px=self.lease_ms))
        if held:
            self._lease_renewed_at = now
        return held

    def _take_over(self) -> None:
        """Become the active scheduler: reset workers and rebuild the pool from Redis."""
        log.info("scheduler %s is active", self.consumer)
        try:
            self.redis.xgroup_create(self.keys.requests, self.keys.scheduler_group, id="0",
                                     mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._refresh_workers()
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self.keys.results)  # answers to a predecessor's plans
        for wid, w in self.core.workers.items():
            pipe.delete(self.keys.plans(wid))
            pipe.rpush(self.keys.plans(wid), encode(IterationPlan(iteration=0, reset=True)))
            w.plans_in_flight = 1
        pipe.execute()
        recovered, cursor = 0, "0-0"
        while True:
            cursor, entries, *_ = self.redis.xautoclaim(
                self.keys.requests, self.keys.scheduler_group, self.consumer, min_idle_time=0,
                start_id=cursor, count=256)
            for entry_id, fields in entries:
                if fields:
                    self._add_submission(entry_id, fields, restore=True)
                    recovered += 1
            if cursor in (b"0-0", "0-0"):
                break
        if recovered:
            log.info("recovered %d unfinished requests", recovered)

    def tick(self) -> None:
        if self._exchange_due:
            self._exchange()
        if time.monotonic() - self._last_refresh > REGISTRY_REFRESH_S:
            self._refresh_workers()
        if self._unheard:
            self._cancel_orphans()
        now = time.time()
        self.core.expire(now)
        for s in self.core.place():
            if s.admitted_at is None:
                s.admitted_at = now
                metrics.QUEUE_TIME.observe(max(0.0, now - s.sub.arrival_time))
        if self.core.failed:
            failed, self.core.failed = self.core.failed, []
            metrics.REQUESTS_FINISHED.labels("error").inc(len(failed))
            self._publish(failed)
            self._trace_dropped(now)
        due = self._send_plans()
        running = sum(len(w.running) for w in self.core.workers.values())
        metrics.REQUESTS_RUNNING.set(running)
        for model, n in self.core.waiting_by_model().items():
            metrics.REQUESTS_WAITING.labels(model).set(n)
        if len(self.core.waiting) != self._published_waiting:
            self._published_waiting = len(self.core.waiting)
            # Published before it is set: whoever reads the key's new value finds the gateways
            # told already.
            self._outbox.publish(self.keys.waiting_updates, self._published_waiting)
            self._outbox.set(self.keys.waiting, self._published_waiting)
        if due is not None:
            self._alarm.set(due)
        # One round trip: this tick's writes (plans, token events, progress, the waiting count),
        # then sleep until a result or a wake-up (a new request or cancel, or the alarm of a held
        # plan) arrives, then look whether another wake-up waits behind it. One result a tick: a
        # second one queued behind it returns at once next tick.
        pipe = self._outbox
        pipe.blpop([self.keys.results, self.keys.wakeups], timeout=WAIT_S)
        pipe.exists(self.keys.wakeups)
        *replies, item, waking = pipe.execute()
        self._count_listeners(replies)
        # Requests and cancels are read only once a wake-up announced them (gateways ring after
        # each), so a decode iteration costs the scheduler one round trip instead of three: each
        # trip wakes Redis and the scheduler, CPU a worker on the same cores loses.
        got_result = item is not None and item[0] == self._results_key
        self._exchange_due = not got_result or bool(waking)
        if got_result:
            self._on_result(decode(item[1]))

    def _exchange(self) -> None:
        """Send the outbox and read new requests and cancels, in one round trip. The wake-ups
        that announced them are deleted first in the same trip: one that rings after the
        delete finds its request either read by this trip or waiting for the next tick."""
        pipe = self._outbox
        pipe.delete(self.keys.wakeups)
        pipe.xreadgroup(self.keys.scheduler_group, self.consumer, {self.keys.requests: ">"},
                        count=256)
        pipe.lpop(self.keys.cancels, 256)
        *replies, requests, cancels = pipe.execute()
        self._count_listeners(replies)
        for _stream, entries in requests or []:
            for entry_id, fields in entries:
                self._add_submission(entry_id, fields)
        for raw in cancels or []:
            msg = decode(raw)
            assert isinstance(msg, Cancel)
            event = self._cancel(msg.request_id)
            if event is not None:
                self._publish([event])

    def _cancel(self, request_id: str) -> TokenEvent | None:
        """Drop a request from the pool, counted and traced; returns its final event to publish
        (None when it is not in the pool)."""
        s = self.core.requests.get(request_id)
        event = self.core.cancel(request_id)
        if event is not None:
            metrics.REQUESTS_FINISHED.labels("cancelled").inc()
            if s is not None:
                self._trace_finished(s, "cancelled", s.worker_id, time.time())
        return event

    def _count_listeners(self, replies: list) -> None:
        """Note, from the outbox's replies, which gateway channels had no listener."""
        now = time.monotonic()
        for i, channel in self._published:
            if replies[i]:
                self._unheard.pop(channel, None)
            else:
                self._unheard.setdefault(channel, now)
        self._published.clear()

    def _cancel_orphans(self) -> None:
        """Cancel the requests of each gateway channel without a listener for
        `orphan_timeout_s`: their gateway is gone, and nothing would read their tokens."""
        now = time.monotonic()
        for channel, since in list(self._unheard.items()):
            if now - since < self.orphan_timeout_s:
                continue
            del self._unheard[channel]
            orphans = [rid for rid, ch in self._reply_to.items() if ch == channel]
            events = [e for e in map(self._cancel, orphans) if e is not None]
            if events:
                log.warning("%s has had no listener for %.0f s: its gateway is gone; cancelled "
                            "its %d requests", channel, now - since, len(events))
                metrics.ORPHANED_REQUESTS.inc(len(events))
                self._publish(events)  # acknowledged and their progress deleted, as any end

    def _add_submission(self, entry_id: bytes, fields: dict, restore: bool = False) -> None:
        sub = decode(fields[b"m"])
        assert isinstance(sub, RequestSubmission)
        self.entry_ids[sub.request_id] = entry_id
        self._reply_to[sub.request_id] = sub.reply_to
        self.core.add_request(sub)
        if restore:  # a predecessor's request: pick up from the tokens it had published
            saved = [int(t) for t in self.redis.lrange(self.keys.progress(sub.request_id), 0, -1)]
            state = self.core.requests[sub.request_id]
            state.output_token_ids = saved[: sub.params.max_tokens]
            if len(state.output_token_ids) >= sub.params.max_tokens:
                self.core.cancel(sub.request_id)
                self._publish([TokenEvent(sub.request_id, len(saved), [], finish_reason="length",
                                          prompt_tokens=len(sub.prompt_token_ids),
                                          completion_tokens=len(state.output_token_ids))])

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
                if known is not None and known.info.incarnation != info.incarnation:
                    # Restarted under the same id: the old process and its requests are gone.
                    log.warning("worker %s restarted", wid)
                    self._lose_worker(wid)
                    known = None
                if known is not None:  # keep the fresher free-block count from results
                    info = dataclasses.replace(info, num_free_blocks=known.info.num_free_blocks)
                self.core.update_worker(info)
                seen.add(wid)
        metrics.WORKERS_ALIVE.set(len(seen))
        for wid, w in self.core.workers.items():
            metrics.KV_BLOCKS_FREE.labels(wid).set(w.info.num_free_blocks)
            metrics.KV_BLOCKS_TOTAL.labels(wid).set(w.info.num_total_blocks)
        for wid in list(self.core.workers):
            if wid not in seen:
                self._lose_worker(wid)
                self.redis.srem(self.keys.workers, wid)

    def _lose_worker(self, wid: str) -> None:
        """A worker died: its requests go back to the pool (or fail past --max-migrations)."""
        with contextlib.suppress(KeyError):
            metrics.KV_BLOCKS_FREE.remove(wid)
            metrics.KV_BLOCKS_TOTAL.remove(wid)
        lost = len(self.core.workers[wid].running)
        failed = self.core.remove_worker(wid)
        log.warning("worker %s gone; %d requests back to the pool, %d failed", wid,
                    lost - len(failed), len(failed))
        metrics.REQUESTS_FINISHED.labels("error").inc(len(failed))
        self._publish(failed)
        self._trace_dropped(time.time())
        # Plans queued for the dead process must not reach one restarted under the same id.
        self.redis.delete(self.keys.plans(wid))

    def _send_plans(self) -> float | None:
        """Send each worker that has work plans up to PLANS_AHEAD in flight (an idle worker gets
        two at once, so that the second is queued before the first ends); one to go behind a
        running iteration waits until `Scheduler.plan_due`. Returns the earliest time (monotonic
        seconds) a held plan is due, or None."""
        now, due = time.monotonic(), None
        for wid, w in self.core.workers.items():
            while w.plans_in_flight < PLANS_AHEAD and self.core.has_work(wid):
                if w.plans_in_flight and (at := self.core.plan_due(wid, now)) > now:
                    due = at if due is None else min(due, at)
                    break
                self._send_plan(wid, w, now)
        return due

    def _send_plan(self, wid: str, w: WorkerState, now: float) -> None:
        t0 = time.perf_counter()
        plan = self.core.schedule(wid)
        metrics.SCHEDULING_SECONDS.observe(time.perf_counter() - t0)
        self._outbox.rpush(self.keys.plans(wid), encode(plan))  # sent with the tick's wait
        if not w.plans_in_flight:  # an idle worker starts it at once
            self.core.iteration_started(wid, now)
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
        if w is not None and w.plans_in_flight:  # the plan queued behind this one starts now
            self.core.iteration_started(result.worker_id, time.monotonic())
        now = time.time()
        for e in events:
            s = states.get(e.request_id)
            if s is not None and e.token_ids and s.first_token_at is None:
                s.first_token_at = now
            if s is not None and e.finish_reason is not None:
                metrics.REQUESTS_FINISHED.labels(e.finish_reason).inc()
                self._log_finished(s, e.finish_reason, result.worker_id, now)
                self._trace_finished(s, e.finish_reason, result.worker_id, now)
        self._publish(events)

    def _trace_dropped(self, now: float) -> None:
        """The spans of the requests the scheduler failed itself (`Scheduler.dropped`)."""
        dropped, self.core.dropped = self.core.dropped, []
        for s in dropped:
            self._trace_finished(s, "error", s.worker_id, now)

    def _trace_finished(self, s: RequestState, reason: str, worker_id: str | None,
                        now: float) -> None:
        """The request's span in the scheduler, when its gateway traces it (a cancelled
        request's too: a stop string cancels one)."""
        if self.tracer is not None and s.sub.trace_context is not None:
            tracing.record_schedule_span(
                self.tracer, s.sub, worker_id, reason, len(s.output_token_ids), s.cached_tokens,
                s.migrations, s.admitted_at, s.first_token_at, now)

    @staticmethod
    def _log_finished(s: RequestState, reason: str, worker_id: str, now: float) -> None:
        """One JSON line per finished request; never the prompt, the output or a key."""
        arrival = s.sub.arrival_time

        def since(t: float | None) -> float | None:
            return None if t is None else round(t - arrival, 4)

        log.info(json.dumps({
            "event": "request_finished", "request_id": s.sub.request_id, "model": s.sub.model,
            "worker": worker_id, "priority": s.sub.priority, "arrival_time": round(arrival, 4),
            "prompt_tokens": len(s.sub.prompt_token_ids),
            "generated_tokens": len(s.output_token_ids), "queue_time_s": since(s.admitted_at),
            "ttft_s": since(s.first_token_at), "e2e_s": since(now), "finish_reason": reason,
        }))

    def _publish(self, events: list[TokenEvent]) -> None:
        """Send events to their gateways, one `TokenEvents` message per gateway; save the tokens
        for a scheduler that takes over; acknowledge the stream entry of each finished request.
        All of it goes out with the next tick's reads (`_exchange`)."""
        if not events:
            return
        pipe = self._outbox
        by_channel: dict[str, list[TokenEvent]] = {}
        keys: list[str] = []
        args: list[int] = [PROGRESS_TTL_S]
        for event in events:
            final = event.finish_reason is not None
            channel = (self._reply_to.pop if final else self._reply_to.get)(event.request_id, None)
            if channel is not None:
                by_channel.setdefault(channel, []).append(event)
            if final:
                pipe.delete(self.keys.progress(event.request_id))
                entry = self.entry_ids.pop(event.request_id, None)
                if entry is not None:
                    pipe.xack(self.keys.requests, self.keys.scheduler_group, entry)
            elif event.token_ids:  # saved for a scheduler that takes over
                keys.append(self.keys.progress(event.request_id))
                renew = event.index % PROGRESS_TTL_REFRESH_TOKENS < len(event.token_ids)
                args += [len(event.token_ids), int(renew), *event.token_ids]
        if keys:  # saved before the tokens are published: a successor never has fewer
            # EVAL, not a registered script: redis-py checks a pipeline's scripts with SCRIPT
            # EXISTS, a round trip of its own, at every execute.
            pipe.eval(_APPEND_PROGRESS, len(keys), *keys, *args)
        for channel, batch in by_channel.items():
            self._published.append((len(pipe), channel))
            pipe.publish(channel, encode(TokenEvents(batch)))
