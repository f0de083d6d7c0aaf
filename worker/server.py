"""The worker process: runs the iteration plans the scheduler addresses to it.

It registers (a hash plus a heartbeat key with a TTL), then loops: take the next plan, run one
engine iteration, hand over the result. Redis stays off that loop's critical path without a
thread of its own: the BLPOP for the next plan is sent before an iteration runs and its reply
read after it (the scheduler keeps one plan queued ahead, so it is there), and a result's RPUSH is
sent at once and its reply read with the next one. Waiting on those round trips at each
iteration's end cost 0.4-5 ms (2 on average) per iteration on two cores, where Redis, the
scheduler and the gateway all wake at that moment; threads that popped and pushed for the loop
cost less but woke twice an iteration, each wake-up taking a core from the engine's threads
mid-iteration. A thread renews the heartbeat every second with the current free K/V blocks, and
reads the LoRA adapters the fleet loaded at run time; the loop loads or drops them between
iterations, and the heartbeat advertises what it serves. On
SIGTERM it drains: it advertises `draining`, hands back any request it is asked to admit,
finishes what it runs, deregisters and exits 0.

An iteration whose engine step raises does not end the worker: a request that breaks the engine
(a poison pill) would otherwise end it, be moved to the next one by the scheduler and end that
too, up to `--max-migrations` workers. Nor does it fail every request the iteration held: the
worker frees their K/V blocks and the prefix cache, then finds the culprit by halving, each half
of the suspects recomputed (their prompt and tokens so far, as after a preemption) alone, and a
half that fails halved again. A request that fails alone gets the error (HTTP 500); the others
go on with the token their recompute sampled. That costs about twice the suspects' contexts of
prefill, once, where failing them cost every client its request. Several failed iterations in a
row, or blocks that do not all come back, mean the engine itself is broken: the worker leaves
the fleet. A tensor-parallel leader leaves at once, its followers being out of step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass

import redis

from shoal.keys import Keys
from shoal.messages import (
    IterationPlan,
    IterationResult,
    NewRequest,
    ProtocolError,
    TokenOutput,
    WorkerInfo,
    decode,
    encode,
)
from shoal.model_files import model_id
from worker import metrics
from worker.engine import Engine, KVCacheFullError
from worker.lora import LoRAError

log = logging.getLogger("shoal.worker")

MAX_FAILED_ITERATIONS = 3  # in a row: past it the engine is broken, not one request


@dataclass
class WorkerSettings:
    redis_url: str
    worker_id: str = ""
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = 3.0
    prefix: str = "shoal"
    served_model_name: str | None = None  # the model's name in the API (default: the file's)
    contain_engine_failures: bool = True  # False for a tensor-parallel leader (see above)


class _InFlight:
    """One Redis command sent without waiting for its reply, on a connection of `client`'s pool
    held until the reply is read."""

    def __init__(self, client: redis.Redis) -> None:
        self._pool = client.connection_pool
        self._conn: redis.connection.Connection | None = None

    @property
    def pending(self) -> bool:
        return self._conn is not None

    def send(self, *args: object) -> None:
        """Raises: redis.ConnectionError, redis.TimeoutError (then nothing is in flight)."""
        conn = self._pool.get_connection()
        try:
            conn.send_command(*args)
        except (redis.ConnectionError, redis.TimeoutError):
            self._pool.release(conn)
            raise
        self._conn = conn

    def read(self):
        """The reply of the command in flight (waiting for it if need be).

        Raises: redis.ConnectionError, redis.TimeoutError (then nothing is in flight)."""
        conn, self._conn = self._conn, None
        try:
            return conn.read_response()
        finally:
            self._pool.release(conn)


class PlanFeed:
    """This worker's plans, one BLPOP always in flight on a connection of its own.

    `get` reads the reply of the BLPOP sent earlier (sending one first if none is) and `request`
    sends the next: called before an iteration runs, its plan arrives in the socket's buffer while
    the engine computes, and no thread wakes for it.
    """

    def __init__(self, url: str, key: str, timeout_s: float = 0.5) -> None:
        self._blpop = _InFlight(redis.Redis.from_url(url))
        self._key = key
        self._timeout_s = timeout_s
        self._backoff_s = 0.1

    def request(self) -> None:
        """Send the BLPOP for the next plan, unless one is in flight.

        Raises: redis.ConnectionError, redis.TimeoutError."""
        if not self._blpop.pending:
            self._blpop.send("BLPOP", self._key, self._timeout_s)

    def get(self) -> IterationPlan | None:
        """The next plan, or None after `timeout_s` seconds without one or while Redis is
        unavailable (then after a backoff of up to 2 s: the heartbeat thread re-registers once
        Redis is back, and a scheduler that takes over resets this engine).

        Raises:
            ProtocolError: a plan this worker cannot read.
        """
        try:
            self.request()
            item = self._blpop.read()
        except (redis.ConnectionError, redis.TimeoutError) as e:
            log.warning("Redis unavailable (%s); retrying in %.1f s", e, self._backoff_s)
            time.sleep(self._backoff_s)
            self._backoff_s = min(self._backoff_s * 2, 2.0)
            return None
        self._backoff_s = 0.1
        if item is None:
            return None
        plan = decode(item[1])
        if not isinstance(plan, IterationPlan):
            raise ProtocolError(f"expected an IterationPlan on {self._key}, "
                                f"got {type(plan).__name__}")
        return plan


class ResultSink:
    """Pushes iteration results to the scheduler's list without waiting for Redis: each RPUSH is
    sent at once and its reply read when the next is sent (it is there by then) or at `flush`."""

    def __init__(self, url: str, key: str) -> None:
        self._rpush = _InFlight(redis.Redis.from_url(url))
        self._key = key
        self._iteration = 0  # of the RPUSH in flight

    def push(self, result: IterationResult) -> None:
        self.flush()
        self._iteration = result.iteration
        try:
            self._rpush.send("RPUSH", self._key, encode(result))
        except (redis.ConnectionError, redis.TimeoutError) as e:
            self._lost(e)

    def flush(self) -> None:
        """Read the reply of the RPUSH in flight, if any: its result has then reached Redis."""
        if self._rpush.pending:
            try:
                self._rpush.read()
            except (redis.ConnectionError, redis.TimeoutError) as e:
                self._lost(e)

    def _lost(self, e: Exception) -> None:
        # Lost with the connection, as the plans in flight are: a scheduler that takes over
        # resets this engine and admits its requests again.
        log.warning("Redis unavailable (%s); iteration %d's result may be lost", e, self._iteration)


class WorkerServer:
    """Connects one engine to the fleet through Redis."""

    def __init__(self, engine: Engine, model_path, settings: WorkerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.worker_id = settings.worker_id or f"worker-{uuid.uuid4().hex[:8]}"
        self.model = settings.served_model_name or model_id(model_path)
        self.keys = Keys(settings.prefix)
        self.redis = redis.Redis.from_url(settings.redis_url)
        self._draining = threading.Event()
        self._stopped = threading.Event()
        self._heartbeats: threading.Thread | None = None  # the thread of `_heartbeat_loop`
        self.incarnation = uuid.uuid4().hex[:12]
        self._totals = metrics.EngineTotals()
        self._failed_in_a_row = 0
        # LoRA adapters loaded at run time (`Keys.loras`): the list the heartbeat thread last
        # read, what the engine serves and what failed, both advertised in `info`. The main
        # thread alone changes the engine's adapters, between iterations (`_sync_loras`).
        self._static_loras = dict(engine.cfg.lora_modules)
        self._wanted_loras: dict[str, str] | None = None
        self._synced_loras: dict[str, str] | None = None  # the list `_sync_loras` last matched
        self._lora_paths = dict(self._static_loras)
        self._lora_failed: dict[str, tuple[str, str]] = {}  # name -> (path, why)

    def info(self) -> WorkerInfo:
        e = self.engine
        return WorkerInfo(self.worker_id, self.model, e.num_total_blocks, e.num_free_blocks,
                          e.block_size, e.cfg.max_num_seqs, e.max_model_len, len(e.running),
                          self._draining.is_set(), self.incarnation, time.time(),
                          e.cfg.max_num_batched_tokens, e.cfg.enable_prefix_caching,
                          self._lora_paths,
                          {n: list(failed) for n, failed in self._lora_failed.items()})

    def _read_loras(self, r: redis.Redis) -> None:
        """Read the fleet's run-time adapters (for `_sync_loras`)."""
        self._wanted_loras = {k.decode(): v.decode()
                              for k, v in r.hgetall(self.keys.loras(self.model)).items()}

    def _sync_loras(self) -> None:
        """Load the run-time adapters the fleet lists and this worker lacks, and drop those it
        no longer lists once no running request uses them (`--lora-modules`' stay). A path
        that changed is loaded again; one that fails is advertised in `lora_errors` and not
        tried again until its path changes. Runs between iterations, in the main thread."""
        wanted = self._wanted_loras
        if wanted is None or wanted is self._synced_loras:
            return
        paths = dict(self._lora_paths)
        failed = {n: f for n, f in self._lora_failed.items() if wanted.get(n) == f[0]}
        for name, path in wanted.items():
            if name in self._static_loras or paths.get(name) == path or name in failed:
                continue
            try:
                self.engine.add_lora(name, path)
                paths[name] = path
                log.info("worker %s loaded LoRA adapter %s from %s", self.worker_id, name, path)
            except LoRAError as e:
                failed[name] = (path, str(e))
                log.warning("worker %s cannot load LoRA adapter %s: %s", self.worker_id, name, e)
        in_use = False
        for name in [n for n in paths if n not in wanted and n not in self._static_loras]:
            if self.engine.remove_lora(name):
                del paths[name]
                log.info("worker %s dropped LoRA adapter %s", self.worker_id, name)
            else:
                in_use = True  # its requests finish first: tried again next time
        self._lora_paths, self._lora_failed = paths, failed  # replaced whole: the heartbeat reads
        self._synced_loras = None if in_use else wanted

    def _heartbeat(self, r: redis.Redis) -> None:
        self._read_loras(r)
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

    def _stop_heartbeats(self) -> None:
        """Stop the heartbeat thread and wait out a heartbeat it is writing: one that lands after
        the deregistration would bring the worker back, a ghost the gateway counts as ready and
        the scheduler places requests on, until its key expires. Waits at most the heartbeat's
        TTL (a heartbeat stuck on a Redis that is gone)."""
        self._stopped.set()
        thread = self._heartbeats
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.settings.heartbeat_ttl_s)

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
        self._stop_heartbeats()
        with contextlib.suppress(redis.RedisError):
            self._deregister()
        logging.shutdown()
        os._exit(1)  # from any thread: the main one may be blocked in a collective

    def drain(self, *_: object) -> None:
        """Stop taking new requests; the loop exits once the running ones are done."""
        self._draining.set()

    def run(self) -> int:
        """Serve until drained. Returns the process exit status: 0, or 1 after a plan this worker
        cannot read (another protocol version), having left the fleet."""
        signal.signal(signal.SIGTERM, self.drain)
        signal.signal(signal.SIGINT, self.drain)
        self._read_loras(self.redis)
        self._sync_loras()  # the fleet's run-time adapters, before the first heartbeat
        self._heartbeat(self.redis)
        self._heartbeats = threading.Thread(target=self._heartbeat_loop, daemon=True)
        self._heartbeats.start()
        plans = PlanFeed(self.settings.redis_url, self.keys.plans(self.worker_id))
        results = ResultSink(self.settings.redis_url, self.keys.results)
        levels, projections, level_rows = self.engine.model.levels_served()
        stack_rows = self.engine.model.stack_max_rows  # 0 where decode_stack does not serve
        log.info("worker %s serving %s with %d K/V blocks; %d of %d projections read the file's "
                 "4-bit levels in iterations of up to %d rows; %s", self.worker_id, self.model,
                 self.engine.num_total_blocks, levels, projections, level_rows,
                 f"all layers in one call up to {stack_rows} rows" if stack_rows
                 else "layers called one op at a time")
        status = 0
        try:
            while not (self._draining.is_set() and not self.engine.running):
                self._sync_loras()
                plan = plans.get()
                if plan is None:
                    continue
                plans.request()  # the next plan arrives while this one runs
                results.push(self.step(plan))
        except ProtocolError as e:
            log.error("worker %s cannot read its plans (%s); leaving the fleet", self.worker_id, e)
            status = 1
        finally:
            results.flush()  # the last results reach the scheduler before we leave
            self._stop_heartbeats()
            with contextlib.suppress(redis.RedisError):
                self._heartbeat(self.redis)  # last word: draining, with what is left
                self._deregister()
        return status

    def step(self, plan: IterationPlan) -> IterationResult:
        """One iteration; admissions while draining and requests preempted for lack of K/V blocks
        are handed back with `finish_reason="preempted"` for the scheduler to place again."""
        handed_back: list[TokenOutput] = []
        if self._draining.is_set() and plan.admit:
            handed_back += [TokenOutput(a.request_id, None, len(a.output_token_ids),
                                        finish_reason="preempted") for a in plan.admit]
            plan = IterationPlan(plan.iteration, [], plan.run, plan.release, plan.reset)
        while True:
            # Each running request's tokens the scheduler knows of, should the step fail after
            # sampling some of them.
            known = {rid: len(s.token_ids) for rid, s in self.engine.running.items()}
            try:
                result = self.engine.step(plan)
                if result.num_requests:  # an iteration that computed something went well
                    self._failed_in_a_row = 0
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
            except Exception as e:  # noqa: BLE001 - any engine failure, contained below
                if not self.settings.contain_engine_failures:
                    raise
                return self._failed_iteration(plan, e, handed_back, known)
        metrics.observe_iteration(result.num_prefill_tokens, result.num_decode_tokens,
                                  result.step_seconds, self.engine.num_free_blocks,
                                  self.engine.num_total_blocks)
        self._totals.observe(self.engine)
        return IterationResult(self.worker_id, result.iteration, handed_back + result.outputs,
                               self.engine.num_free_blocks, result.num_prefill_tokens,
                               result.num_decode_tokens, result.step_seconds, result.num_requests,
                               result.num_pending_prefill_tokens)

    def _failed_iteration(self, plan: IterationPlan, e: Exception,
                          handed_back: list[TokenOutput], known: dict[str, int]
                          ) -> IterationResult:
        """The result of an iteration whose engine step raised `e`: the engine emptied and its
        prefix cache forgotten (a block of the failed iteration may be half written), then
        every request it held, and the plan's admissions, recomputed in halves (`_isolate`),
        those that fail alone finished with an error (status 500). `known`: each running
        request's length in tokens before the step. Ends the worker (`fail`) after
        MAX_FAILED_ITERATIONS in a row, or when blocks stay missing."""
        self._failed_in_a_row += 1
        metrics.FAILED_ITERATIONS.inc()
        log.exception("iteration %d failed (%d in a row); finding the request that broke it",
                      plan.iteration, self._failed_in_a_row, exc_info=e)
        if self._failed_in_a_row >= MAX_FAILED_ITERATIONS:
            self.fail(f"{self._failed_in_a_row} iterations in a row failed: {e!r}")
        engine = self.engine
        done = {o.request_id for o in handed_back}
        suspects = {a.request_id: a for a in plan.admit}
        for rid, seq in engine.running.items():
            if rid not in suspects:
                n = known.get(rid, len(seq.token_ids))
                suspects[rid] = NewRequest(rid, seq.token_ids[:seq.num_prompt_tokens], seq.params,
                                           seq.token_ids[seq.num_prompt_tokens:n])
        for rid in list(engine.running):
            engine.release(rid)
        engine.reset_prefix_cache()
        missing = engine.num_total_blocks - engine.num_free_blocks
        if missing:
            self.fail(f"the engine failed ({e!r}) and {missing} K/V blocks did not come back")
        outputs, steps = self._isolate([r for rid, r in suspects.items() if rid not in done], e)
        if any(s.num_requests for s in steps):  # some requests ran: the engine itself works
            self._failed_in_a_row = 0
        self._totals.observe(engine)
        return IterationResult(
            self.worker_id, plan.iteration, handed_back + outputs, engine.num_free_blocks,
            sum(s.num_prefill_tokens for s in steps), sum(s.num_decode_tokens for s in steps),
            sum(s.step_seconds for s in steps), len({o.request_id for o in outputs}),
            steps[-1].num_pending_prefill_tokens if steps else 0)

    def _isolate(self, suspects: list[NewRequest], e: Exception
                 ) -> tuple[list[TokenOutput], list[IterationResult]]:
        """Find which of a failed iteration's requests break the engine (`e` being what it
        raised), by halving: each half is admitted alone and run until every one of its
        requests has computed its context again and sampled (`_recompute`); a half that raises
        is released and halved again, and a request that raises alone is the culprit. Returns
        the outputs (the survivors' tokens, the culprits' errors, requests handed back when a
        half found too few free blocks, its prefix blocks no longer shared) and the engine's
        steps that ran."""
        def culprit(r: NewRequest, err: Exception) -> TokenOutput:
            log.error("request %s breaks the engine: %r", r.request_id, err)
            metrics.FAILED_REQUESTS.inc()
            return TokenOutput(r.request_id, None, len(r.output_token_ids), finish_reason="error",
                               error=f"the worker's engine failed running this request: "
                                     f"{type(err).__name__}: {err}", error_status=500)
        engine = self.engine
        outputs: list[TokenOutput] = []
        steps: list[IterationResult] = []
        if len(suspects) < 2:  # the iteration ran it alone
            return [culprit(r, e) for r in suspects], steps
        groups = deque(_halves(suspects))
        while groups:
            group = groups.popleft()
            try:
                outputs += self._recompute(group, steps)
            except KVCacheFullError:
                outputs += [TokenOutput(r.request_id, None, len(r.output_token_ids),
                                        finish_reason="preempted") for r in group]
            except Exception as err:  # noqa: BLE001 - the failure being looked for
                engine.reset_prefix_cache()  # as after the iteration: a block may be half written
                if len(group) == 1:
                    outputs.append(culprit(group[0], err))
                else:
                    groups.extendleft(reversed(_halves(group)))
        return outputs, steps

    def _recompute(self, group: list[NewRequest], steps: list[IterationResult]
                   ) -> list[TokenOutput]:
        """Admit `group` and step it alone until each of its requests has sampled (or
        finished); the steps are appended to `steps`. On any exception the group's requests are
        released (their outputs dropped: the scheduler never sees them) and it propagates."""
        engine = self.engine
        ids = [r.request_id for r in group]
        plan = IterationPlan(admit=group, run=[])
        outputs: list[TokenOutput] = []
        try:
            while True:
                result = engine.step(plan)
                steps.append(result)
                outputs += result.outputs
                prefilling = [rid for rid in ids if rid in engine.running
                              and engine.running[rid].num_uncomputed_tokens > 1]
                if not prefilling or not result.num_requests:
                    return outputs
                plan = IterationPlan(run=prefilling)
        except BaseException:
            for rid in ids:
                engine.release(rid)
            raise


def _halves(group: list[NewRequest]) -> list[list[NewRequest]]:
    return [group[:len(group) // 2], group[len(group) // 2:]]


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
