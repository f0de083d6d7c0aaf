"""The scheduling policy: which requests run in each worker's next iteration.

Orca's Algorithm 1 (OSDI'22, §4.1) generalised to many workers, with no I/O in this module:

- the lowest `priority` value first (interactive 0, batch jobs 1), first come first served within a
  priority. Aging keeps batch work from starving: a waiting request's effective priority drops
  by one level for every `priority_aging_s` seconds it has waited, and among equal effective
  priorities the earlier arrival goes first, so a batch request waits at most about
  `priority * priority_aging_s` behind a steady stream of interactive ones;
- at most `max_num_seqs` requests per worker;
- a waiting request is admitted only where the worker's K/V covers it. Policy `reserve` (Orca):
  blocks for prompt + `max_tokens` are reserved at admission, so a worker never runs out;
  `ondemand` (vLLM): only the prompt's blocks must be free now, requests grow into free blocks, and
  a worker that runs out preempts its newest request, which comes back here to be recomputed;
- placement: the alive, non-draining worker for the model with the most free blocks (ties: the
  fewest running requests), unless another whose prefix cache likely holds the request's first
  blocks has nearly as many and runs not many more requests (`PREFIX_AFFINITY_SLACK`,
  `PREFIX_AFFINITY_REQUESTS`): the choices of one prompt, the turns of
  a conversation and the requests behind one system prompt then find their prefix cached instead
  of computing it on every worker. What a worker holds is estimated from what was placed on it
  (`PrefixIndex`), as SGLang's cache-aware router does;
- policy `request-level` is the Orca paper's baseline (FasterTransformer-style request-level
  batching), for `shoal bench`: a worker takes a batch only when it is idle, fills it with what
  fits (reserving like `reserve`), and takes nothing more until every request of the batch has
  finished; requests arriving meanwhile wait.
- finished requests leave at once and new ones join at the next iteration;
- the plan queued behind a running prefill is made late: the I/O loop keeps one plan queued
  behind the running iteration so that the engine never waits on Redis, but a plan made as soon
  as the previous one was sent left every request arriving during a long prefill iteration for
  the iteration after the next. `plan_due` holds it until shortly before the running iteration's
  estimated end: its prompt tokens, capped by the worker's `max_num_batched_tokens`, at the
  lowest seconds per token of recent prefill iterations. Small iterations cost more per token,
  so the estimate errs short, and a plan made early is only what happened before; one made late
  would idle the worker. On two cores, Poisson arrivals of the `orca` workload at 6 requests/s:
  TTFT p90 209-261 -> 191-226 ms, p99 269-354 -> 241-288 ms, throughput unchanged.

`schedule(worker_id)` makes a plan; `postprocess(result)` consumes a result and returns the token
events for the gateways. The I/O loop around them is scheduler/server.py.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field, replace

from shoal.messages import (
    IterationPlan,
    IterationResult,
    NewRequest,
    RequestSubmission,
    TokenEvent,
    WorkerInfo,
)
from shoal.prefix_hash import lookup_hashes

POLICIES = ("reserve", "ondemand", "request-level")

# A plan queued behind a running prefill goes this long before the iteration's estimated end (the
# scheduler's tick, a Redis round trip and the worker's pop, with room for a busy machine), or a
# fifth of the estimate before it if that is more.
PLAN_LEAD_S = 0.010
PLAN_LEAD_FRACTION = 0.2
# Prefill iterations of at least this many prompt tokens teach the seconds per token, the last
# LEARN_SAMPLES of them.
LEARN_MIN_PREFILL_TOKENS = 128
LEARN_SAMPLES = 16
# Placement follows a request's cached prefix to a worker whose room is at most this share of
# the roomiest candidate's total blocks below that candidate's: affinity while the load is near
# even, the roomiest worker once it is not (a popular system prompt must not pile every request
# onto one worker).
PREFIX_AFFINITY_SLACK = 0.125
# ... and while it runs fewer than this many requests more than the least busy candidate: free
# K/V alone is no measure of load where pools are large. Without this guard, `shoal chaos
# --requests 24 --workers 2 --max-tokens 160 --kill-interval 1.5` (one prompt for all) failed
# all 24 requests with one worker's kills; with it 12, as placement by free K/V alone did.
PREFIX_AFFINITY_REQUESTS = 8
# Seconds a request naming a LoRA adapter no worker of its model serves waits before it fails
# (404): the scheduler learns of an adapter loaded at run time (gateway/loras.py) from the
# workers' heartbeats, up to a registry read later than the gateway that loaded it.
LORA_GRACE_S = 5.0


@dataclass
class RequestState:
    """A request in the pool: its submission and the tokens generated so far."""

    sub: RequestSubmission
    output_token_ids: list[int] = field(default_factory=list)
    worker_id: str | None = None
    reserved_blocks: int = 0

    cached_tokens: int = 0  # of its prompt, found in the prefix cache when it first ran
    migrations: int = 0  # times its worker was lost under it
    admitted_at: float | None = None  # Unix time of the first admission, for metrics and logs
    first_token_at: float | None = None
    # Tokens generated but not yet published, under a `stream_interval` above 1 (one event, every
    # token since the last published one); None when there are none.
    held: TokenEvent | None = None

    _hashes: tuple[int, int, list[bytes]] | None = None  # (block size, tokens, their hashes)

    @property
    def num_tokens(self) -> int:
        return len(self.sub.prompt_token_ids) + len(self.output_token_ids)

    def prefix_hashes(self, block_size: int) -> list[bytes]:
        """The keys a worker's prefix cache would look this request up by, over its prompt and
        output so far (`shoal.prefix_hash.lookup_hashes`)."""
        if self._hashes is None or self._hashes[:2] != (block_size, self.num_tokens):
            tokens = [*self.sub.prompt_token_ids, *self.output_token_ids]
            self._hashes = (block_size, self.num_tokens,
                            lookup_hashes(tokens, block_size, self.sub.params))
        return self._hashes[2]


class PrefixIndex:
    """An estimate of the prefix blocks a worker holds: the block hashes of the requests placed on
    it, the most recently placed `capacity` of them (its K/V blocks), as its cache evicts the
    least recently used. It knows nothing of evictions made sooner (another worker's preemptions,
    a cache full of other work), so a placement it suggests may find less than it expected; the
    request then computes what is missing."""

    def __init__(self) -> None:
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def match(self, hashes: list[bytes]) -> int:
        """How many of `hashes`, from the first, the worker is thought to hold."""
        n = 0
        for h in hashes:
            if h not in self._hashes:
                break
            n += 1
        return n

    def add(self, hashes: list[bytes], capacity: int) -> None:
        """Note `hashes` as the most recent, keeping at most `capacity` blocks."""
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > capacity:
            self._hashes.popitem(last=False)

    def clear(self) -> None:
        self._hashes.clear()


@dataclass
class WorkerState:
    """What the scheduler knows of a worker: its latest heartbeat and the requests placed on it."""

    info: WorkerInfo
    running: set[str] = field(default_factory=set)
    reserved_blocks: int = 0
    plans_in_flight: int = 0
    pending_prompt_tokens: int = 0  # prompt tokens left to compute after its latest result
    last_plan_prompt_tokens: int = 0  # prompt tokens that the latest plan admits
    plan_due_at: float | None = None  # when to send the plan behind its running iteration
    iteration: int = 0
    pending_release: list[str] = field(default_factory=list)
    to_admit: list[RequestState] = field(default_factory=list)
    prefix_index: PrefixIndex = field(default_factory=PrefixIndex)

    @property
    def free_blocks(self) -> int:
        """Blocks the scheduler may still promise: total minus reservations (reserve policy)."""
        return self.info.num_total_blocks - self.reserved_blocks


class Scheduler:
    """The request pool and the per-worker admission decisions.

    Args:
        policy: "reserve", "ondemand" or "request-level".
        max_num_seqs: cap on requests per worker per iteration (the worker's own cap applies too).
        max_migrations: a request whose worker is lost more often than this fails.
        queue_deadline_s: a request still waiting this long after its arrival fails (0: never).
        priority_aging_s: seconds of waiting that raise a request by one priority level.
        stream_interval: tokens a request's events carry (SGLang's `--stream-interval`): its
            first token goes at once, then its tokens go `stream_interval` at a time, the rest
            with its last event. Above 1 the gateways, Redis and this loop handle that many
            times fewer events per token, for a burstier stream (`to_publish`).

    Raises:
        ValueError: an unknown policy or a `stream_interval` below 1.
    """

    def __init__(self, policy: str = "reserve", max_num_seqs: int = 256,
                 max_migrations: int = 3, queue_deadline_s: float = 0.0,
                 priority_aging_s: float = 30.0, stream_interval: int = 1) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, not {stream_interval}")
        self.stream_interval = stream_interval
        self.policy = policy
        self.reserves = policy in ("reserve", "request-level")  # blocks for prompt + max_tokens
        self.max_num_seqs = max_num_seqs
        self.max_migrations = max_migrations
        self.queue_deadline_s = queue_deadline_s
        self.priority_aging_s = priority_aging_s
        self.waiting: deque[RequestState] = deque()  # in arrival order, every priority
        self._levels: Counter[int] = Counter()  # waiting requests per priority
        self._models: Counter[str] = Counter()  # waiting requests per model
        self.requests: dict[str, RequestState] = {}
        self.workers: dict[str, WorkerState] = {}
        self.failed: list[TokenEvent] = []  # failed by `place`, for the I/O loop to publish
        # Every request failed here (by `place`, `expire` or `remove_worker`), for the I/O
        # loop's traces; it empties the list as it reads it.
        self.dropped: list[RequestState] = []
        # Seconds per token of recent prefill iterations (any worker); their lowest is what
        # `iteration_started` estimates with.
        self._seconds_per_token: deque[float] = deque(maxlen=LEARN_SAMPLES)

    # -- inputs ---------------------------------------------------------------------------------

    def add_request(self, sub: RequestSubmission) -> None:
        if sub.request_id in self.requests:
            return  # a redelivered stream entry
        state = RequestState(sub)
        self.requests[sub.request_id] = state
        self._enqueue(state)

    def _enqueue(self, state: RequestState) -> None:
        """Insert by arrival time: a requeued (preempted) request keeps its place in line."""
        self.waiting.append(state)
        self._levels[state.sub.priority] += 1
        self._models[state.sub.model] += 1
        if len(self.waiting) > 1 and self.waiting[-2].sub.arrival_time > state.sub.arrival_time:
            self.waiting = deque(sorted(self.waiting, key=lambda s: s.sub.arrival_time))

    def update_worker(self, info: WorkerInfo) -> None:
        w = self.workers.get(info.worker_id)
        if w is None:
            self.workers[info.worker_id] = WorkerState(info)
        else:
            if info.incarnation != w.info.incarnation:
                w.prefix_index.clear()  # a new process: its cache starts empty
            w.info = info

    def remove_worker(self, worker_id: str) -> list[TokenEvent]:
        """A worker died or left. Its requests go back to the pool with the tokens generated so
        far, to be prefilled again elsewhere (recompute); one lost more than `max_migrations`
        times fails instead. Returns the failure events."""
        w = self.workers.pop(worker_id, None)
        if w is None:
            return []
        failed = []
        for rid in w.running:
            s = self.requests.get(rid)
            if s is None:
                continue
            s.worker_id, s.reserved_blocks = None, 0
            s.migrations += 1
            if s.migrations > self.max_migrations:
                del self.requests[rid]
                self.dropped.append(s)
                failed += self.to_publish(s, self._event(
                    s, [], "error", f"request failed: its worker was lost {s.migrations} times "
                    f"(limit {self.max_migrations})", status=503))
            else:
                self._enqueue(s)
        return failed

    def cancel(self, request_id: str) -> TokenEvent | None:
        """Drop a request (client gone, stop string hit). Returns its final event, or None if it
        is not in the pool."""
        s = self.requests.pop(request_id, None)
        if s is None:
            return None
        if s.worker_id is None:
            i = next((i for i, x in enumerate(self.waiting) if x.sub.request_id == request_id),
                     None)
            if i is not None:
                self._dequeue(i)
        else:
            w = self.workers.get(s.worker_id)
            if w:
                w.to_admit = [x for x in w.to_admit if x.sub.request_id != request_id]
                w.pending_release.append(request_id)  # the worker frees its blocks
            self._unplace(s)
        return self._event(s, [], "cancelled")

    # -- decisions ------------------------------------------------------------------------------

    def _blocks_needed(self, s: RequestState, w: WorkerState) -> int:
        bs = w.info.block_size
        if self.reserves:
            total = min(len(s.sub.prompt_token_ids) + s.sub.params.max_tokens, w.info.max_model_len)
        else:
            # A request that may outgrow the window (context_overflow) never holds more than it.
            total = min(s.num_tokens + 1, w.info.max_model_len)
        return -(-total // bs)

    def _room(self, w: WorkerState) -> int:
        if self.reserves:
            return w.free_blocks
        return w.info.num_free_blocks  # advertised, as of its last result

    def expire(self, now: float) -> None:
        """Fail waiting requests older than `queue_deadline_s` (Unix time `now`), into `failed`."""
        if not self.queue_deadline_s:
            return
        keep: deque[RequestState] = deque()
        for s in self.waiting:
            if now - s.sub.arrival_time > self.queue_deadline_s and s.admitted_at is None:
                del self.requests[s.sub.request_id]
                self.dropped.append(s)
                self.failed += self.to_publish(s, self._event(
                    s, [], "error", f"the request waited more than {self.queue_deadline_s:g} s "
                    "for a worker", status=503))
            else:
                keep.append(s)
        self.waiting = keep
        self._levels = Counter(s.sub.priority for s in keep)
        self._models = Counter(s.sub.model for s in keep)

    def waiting_by_model(self) -> dict[str, int]:
        """Requests waiting per model, every model that ever had one included (at 0 now)."""
        return dict(self._models)

    def _dequeue(self, i: int) -> RequestState:
        """Take `waiting[i]` out of the queue and its counts."""
        s = self.waiting[i]
        del self.waiting[i]
        self._levels[s.sub.priority] -= 1
        self._models[s.sub.model] -= 1
        return s

    def _next_waiting(self, now: float, blocked: set[str]) -> int | None:
        """Index in `waiting` of the request to place next among those of models not in
        `blocked`: the lowest effective priority (priority minus whole `priority_aging_s` periods
        waited), earliest arrival among equals; None when every waiting request's model is
        blocked.

        `waiting` is in arrival order, so each priority's first entry is its candidate; the scan
        stops once every priority present has been seen (at once when all share one and no
        model is blocked)."""
        if blocked and all(n == 0 or m in blocked for m, n in self._models.items()):
            return None
        levels = {p for p, n in self._levels.items() if n > 0}
        if len(levels) <= 1 and not blocked:
            return 0 if self.waiting else None
        best, best_key = None, None
        for i, s in enumerate(self.waiting):
            if s.sub.priority not in levels or s.sub.model in blocked:
                continue
            levels.discard(s.sub.priority)
            waited = max(0.0, now - s.sub.arrival_time)
            aged = int(waited // self.priority_aging_s) if self.priority_aging_s > 0 else 0
            key = (s.sub.priority - aged, s.sub.arrival_time)
            if best_key is None or key < best_key:
                best, best_key = i, key
            if not levels:
                break
        return best

    def _fail_waiting(self, i: int, error: str, status: int) -> None:
        """Fail the waiting request at index `i` now: it could never be placed."""
        s = self.waiting[i]
        self._dequeue(i)
        del self.requests[s.sub.request_id]
        self.dropped.append(s)
        self.failed += self.to_publish(s, self._event(s, [], "error", error, status=status))

    def place(self, now: float | None = None) -> list[RequestState]:
        """Assign waiting requests, by priority then arrival (see `_next_waiting`; `now` is Unix
        time, default the clock), to the worker of their model with the most free K/V or,
        nearly as free, the one likely to hold their prefix (`_prefix_home`). A request that
        must wait holds back the rest of its model's queue, not other models'. A request naming
        a LoRA adapter goes only to workers that serve it, and fails (404) where none of its
        model's has for `LORA_GRACE_S`. Returns those placed."""
        now = time.time() if now is None else now
        placed: list[RequestState] = []
        blocked: set[str] = set()  # models whose next request waits
        # request-level: only workers idle now may take requests (this call forms their batch).
        idle = ({w.info.worker_id for w in self.workers.values() if not w.running}
                if self.policy == "request-level" else None)
        while (i := self._next_waiting(now, blocked)) is not None:
            s = self.waiting[i]
            lora = s.sub.params.lora_name  # placed only where that adapter is served
            candidates = [w for w in self.workers.values()
                          if w.info.model == s.sub.model and not w.info.draining
                          and len(w.running) < min(self.max_num_seqs, w.info.max_num_seqs)
                          and (idle is None or w.info.worker_id in idle)
                          and (lora is None or lora in w.info.loras)]
            if not candidates:
                if (lora is not None and now - s.sub.arrival_time > LORA_GRACE_S
                        and not any(lora in w.info.loras for w in self.workers.values()
                                    if w.info.model == s.sub.model)):
                    self._fail_waiting(i, f"LoRA adapter {lora!r} is not loaded on any worker "
                                       f"of {s.sub.model!r}", 404)
                    continue
                blocked.add(s.sub.model)
                continue
            best = self._prefix_home(s, candidates,
                                     max(candidates, key=lambda w: (self._room(w), -len(w.running))))
            need = self._blocks_needed(s, best)
            largest = max(w.info.num_total_blocks for w in candidates)
            if need > largest:  # it would wait forever: fail it now
                self._fail_waiting(i, f"the request needs {need} K/V blocks (prompt + "
                                   f"max_tokens); the largest worker has {largest}", 400)
                continue
            if need > self._room(best):
                blocked.add(s.sub.model)  # it waits; nothing of its model overtakes it
                continue
            self._dequeue(i)
            s.worker_id = best.info.worker_id
            s.reserved_blocks = need if self.reserves else 0
            best.reserved_blocks += s.reserved_blocks
            best.running.add(s.sub.request_id)
            if self.policy == "ondemand":
                # Count the promise against the advertised blocks until the next result.
                best.info = replace(best.info, num_free_blocks=best.info.num_free_blocks - need)
            best.to_admit.append(s)
            if best.info.prefix_caching:
                best.prefix_index.add(s.prefix_hashes(best.info.block_size),
                                      best.info.num_total_blocks)
            placed.append(s)
        return placed

    def _prefix_home(self, s: RequestState, candidates: list[WorkerState],
                     roomiest: WorkerState) -> WorkerState:
        """The candidate thought to hold the longest run of `s`'s first blocks in its prefix
        cache, among those with room for `s`, within `PREFIX_AFFINITY_SLACK` of `roomiest`'s
        room and fewer than `PREFIX_AFFINITY_REQUESTS` requests busier than the least busy
        candidate (the most room among equal runs); `roomiest` where none holds any."""
        floor = self._room(roomiest) - PREFIX_AFFINITY_SLACK * roomiest.info.num_total_blocks
        busiest = min(len(w.running) for w in candidates) + PREFIX_AFFINITY_REQUESTS
        home, home_key = roomiest, (0, 0)
        for w in candidates:
            room = self._room(w)
            if (not w.info.prefix_caching or room < floor or len(w.running) >= busiest
                    or self._blocks_needed(s, w) > room):
                continue
            key = (w.prefix_index.match(s.prefix_hashes(w.info.block_size)), room)
            if key[0] and key > home_key:
                home, home_key = w, key
        return home

    def schedule(self, worker_id: str) -> IterationPlan:
        """The next plan for one worker: new admissions and releases; every running request runs."""
        w = self.workers[worker_id]
        admit = [NewRequest(s.sub.request_id, s.sub.prompt_token_ids, s.sub.params,
                            list(s.output_token_ids)) for s in w.to_admit]
        w.to_admit = []
        w.last_plan_prompt_tokens = sum(len(a.prompt_token_ids) + len(a.output_token_ids)
                                        for a in admit)
        release, w.pending_release = w.pending_release, []
        w.iteration += 1
        return IterationPlan(iteration=w.iteration, admit=admit, run=None, release=release)

    def iteration_started(self, worker_id: str, now: float) -> None:
        """Worker `worker_id` begins the iteration of its latest plan at `now` (monotonic
        seconds): estimate its length from the prompt tokens it computes (what its last result
        left, plus the plan's admissions, up to its token budget) and set when the plan behind it
        is due. No due time (that plan goes at once) for a decode-only iteration or before any
        prefill iteration was measured."""
        w = self.workers.get(worker_id)
        if w is None:
            return
        prompt_tokens = w.pending_prompt_tokens + w.last_plan_prompt_tokens
        budget = w.info.max_num_batched_tokens or prompt_tokens
        prefill = min(prompt_tokens, budget)
        w.plan_due_at = None
        if prefill and self._seconds_per_token:
            seconds = min(self._seconds_per_token) * (prefill + len(w.running))
            w.plan_due_at = now + max(0.0, min(seconds - PLAN_LEAD_S,
                                               seconds * (1 - PLAN_LEAD_FRACTION)))

    def plan_due(self, worker_id: str, now: float) -> float:
        """When (monotonic seconds) the plan queued behind worker `worker_id`'s running iteration
        should be made and sent: shortly before the iteration's estimated end (see
        `iteration_started`), `now` where there is no estimate."""
        w = self.workers[worker_id]
        return now if w.plan_due_at is None else w.plan_due_at

    def has_work(self, worker_id: str) -> bool:
        w = self.workers[worker_id]
        return bool(w.running or w.pending_release or w.to_admit)

    # -- results --------------------------------------------------------------------------------

    def postprocess(self, result: IterationResult) -> list[TokenEvent]:
        """Record a worker's iteration; return the token events to publish."""
        w = self.workers.get(result.worker_id)
        if w is not None:
            w.info = replace(w.info, num_free_blocks=result.num_free_blocks)
            w.pending_prompt_tokens = result.num_pending_prefill_tokens
        if result.num_prefill_tokens >= LEARN_MIN_PREFILL_TOKENS:
            self._seconds_per_token.append(
                result.step_seconds / (result.num_prefill_tokens + result.num_decode_tokens))
        events = []
        for out in result.outputs:
            s = self.requests.get(out.request_id)
            if s is None or s.worker_id != result.worker_id:
                continue  # cancelled, or a stale result from a worker it was taken from
            if out.finish_reason == "preempted":
                self._unplace(s)
                self._enqueue(s)
                continue
            tokens = []
            if out.token_id is not None and out.index == len(s.output_token_ids):
                s.output_token_ids.append(out.token_id)
                tokens = [out.token_id]
                if out.index == 0:
                    s.cached_tokens = out.num_cached_tokens
            if out.finish_reason is not None:
                self._unplace(s)
                self.requests.pop(out.request_id, None)
            # An engine error is about the request itself (see Engine.add_request), unless the
            # worker says the engine failed running it.
            status = (out.error_status or 400) if out.finish_reason == "error" else None
            event = self._event(s, tokens, out.finish_reason, out.error, out.logprob,
                                index=out.index, status=status,
                                top=out.top_logprobs if tokens else None)
            if out.prompt_logprobs is not None:
                event = replace(event, prompt_logprobs=out.prompt_logprobs,
                                prompt_top_logprobs=out.prompt_top_logprobs,
                                prompt_position=out.prompt_position,
                                prompt_ranks=out.prompt_ranks)
            events += self.to_publish(s, event)
        return events

    def to_publish(self, s: RequestState, event: TokenEvent) -> list[TokenEvent]:
        """What to publish of request `s` now that `event` is its next: under a
        `stream_interval` of N, its tokens are held (`RequestState.held`) until N are due, then
        go as one event. The first token (TTFT), the last event (with whatever is held) and the
        prompt's logprobs go at once; an error goes after what is held, in an event of its own
        (the gateway ends a stream at an error without reading its tokens).

        Held tokens are not yet saved for a successor either (the I/O loop saves what it
        publishes): one that takes over computes them again, as it would for a lost worker."""
        held, s.held = s.held, None
        if held is not None:
            if (event.prompt_logprobs is not None or event.finish_reason == "error"
                    or event.token_ids and event.index != held.index + len(held.token_ids)):
                return [held, *self.to_publish(s, event)]
            event = _joined(held, event)
        if (self.stream_interval > 1 and event.finish_reason is None and event.index > 0
                and event.prompt_logprobs is None and len(event.token_ids) < self.stream_interval):
            s.held = event
            return []
        return [event]

    def _unplace(self, s: RequestState) -> None:
        w = self.workers.get(s.worker_id or "")
        if w is not None:
            w.running.discard(s.sub.request_id)
            w.reserved_blocks -= s.reserved_blocks
        s.worker_id, s.reserved_blocks = None, 0

    @staticmethod
    def _event(s: RequestState, tokens: list[int], finish_reason: str | None,
               error: str | None = None, logprob: float | None = None,
               index: int | None = None, status: int | None = None,
               top: list[list] | None = None) -> TokenEvent:
        return TokenEvent(
            request_id=s.sub.request_id,
            index=len(s.output_token_ids) - len(tokens) if index is None else index,
            token_ids=tokens, logprobs=[logprob] * len(tokens), finish_reason=finish_reason,
            error=error, prompt_tokens=len(s.sub.prompt_token_ids),
            completion_tokens=len(s.output_token_ids), error_status=status,
            cached_tokens=s.cached_tokens, top_logprobs=None if top is None else [top],
        )


def _joined(first: TokenEvent, then: TokenEvent) -> TokenEvent:
    """One event for two consecutive events of a request: `first`'s tokens, then `then`'s, and
    `then`'s finish and usage."""
    tops = (first.top_logprobs or []) + (then.top_logprobs or [])
    return replace(then, index=first.index, token_ids=first.token_ids + then.token_ids,
                   logprobs=first.logprobs + then.logprobs, top_logprobs=tops or None)
