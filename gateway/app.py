"""The gateway: OpenAI-compatible HTTP (with Server-Sent Events) and a WebSocket token stream.

It validates and tokenizes a request, subscribes (once, at start-up, to its own channel) before it
enqueues, writes the request to the Redis stream, and turns the token ids coming back into text
incrementally. It knows nothing of batching. The bodies it takes and answers with, and its
errors, are defined in gateway/schemas.py; how a body becomes the fleet's request (token ids,
sampling parameters, stop strings, tool calls) in gateway/prepare.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import hmac
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Annotated, Any, Literal

import redis
import redis.asyncio as aioredis
from fastapi import FastAPI, Query, Request, WebSocket, WebSocketDisconnect
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.body_limit import RequestBodyLimitMiddleware
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import shoal
from gateway import anthropic, metrics, tgi
from gateway.batches import FILES_PATH, batches_router
from gateway.jobs import Jobs, jobs_router
from gateway.loras import RuntimeLoRAs, loras_router
from gateway.models import ModelCatalog, ServedModel
from gateway.pages import pages_router
from gateway.prepare import Prepared, PromptTooLong, RequestPreparation
from gateway.reasoning import Piece
from gateway.responses import (
    TERMINAL,
    ResponseShape,
    ResponsesRequest,
    ResponseStore,
    truncated,
)
from gateway.responses import refusals as responses_refusals
from gateway.schemas import (
    GENERATION_RESPONSES,
    MAX_REQUEST_ID_CHARS,
    RESPONSES_RESPONSES,
    APIError,
    BatchChatRequest,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    FleetStatus,
    FleetWorker,
    GenerationRequest,
    TokenizeRequest,
    error_responses,
    invalid_request,
)
from gateway.sse import ChunkGroup, DataEventStream, EventStream, TypedEventStream
from shoal import tracing
from shoal.detokenizer import IncrementalDetokenizer
from shoal.keys import Keys
from shoal.messages import (
    Cancel,
    RequestSubmission,
    TokenEvent,
    TokenEvents,
    WorkerInfo,
    decode,
    encode,
)
from shoal.process import freeze_heap

log = logging.getLogger("shoal.gateway")
# How long a stopping gateway waits for its background responses to be stored as failed, and
# for the cancels of their requests, seconds.
STOP_RESPONSES_TIMEOUT_S = 5.0

# Each request's commands take a connection of the pool, which grows to the requests in flight:
# a burst of 64 opened 64. Recent redis-py (7.x and 8.x) looks its own version up in the package
# metadata for every new connection of a pool made by `from_url` (importlib.metadata, 5 ms of
# CPU each: 0.33 CPU-seconds in a gateway's first W64 run, on cores the worker needs); one
# lookup serves them all.
try:
    from redis.driver_info import DriverInfo

    _CONNECTION_KWARGS: dict[str, Any] = {"driver_info": DriverInfo()}
except ImportError:  # redis-py without DriverInfo reads its version once, at import
    _CONNECTION_KWARGS = {}


@dataclass
class _Choice:
    """One choice of a request run to its end: its text, token ids, logprobs (and each step's
    most likely tokens, `TokenEvent.top_logprobs`) and last event."""

    text: str = ""
    ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    tops: list[list[list] | None] = field(default_factory=list)
    # prompt position -> (logprob of that prompt token, its position's most likely tokens, its
    # rank there)
    prompt: dict[int, tuple[float, list[list] | None, int | None]] = field(default_factory=dict)
    last: TokenEvent | None = None

    def score(self, ev: TokenEvent) -> None:
        """Record an event's prompt logprobs by position (a recomputed prompt sends them again:
        the same positions, overwritten)."""
        n = len(ev.prompt_logprobs or [])
        for j, (lp, top, rank) in enumerate(zip(ev.prompt_logprobs or [],
                                                ev.prompt_top_logprobs or [None] * n,
                                                ev.prompt_ranks or [None] * n)):
            self.prompt[ev.prompt_position + j] = (lp, top, rank)

    def scored(self, num_prompt_tokens: int) -> bool:
        """Whether every prompt position that has a logprob (all but the first) is recorded."""
        return len(self.prompt) >= num_prompt_tokens - 1

    def echo(self, prompt_ids: list[int], k: int) -> tuple[list[int], list, list]:
        """`echo`'s logprobs of the prompt: its ids, their logprobs (None for the first token,
        which nothing predicts, as in OpenAI's API) and each position's `k` most likely tokens."""
        known = [self.prompt.get(pos, (None, None, None)) for pos in range(1, len(prompt_ids))]
        return (list(prompt_ids), [None] + [lp for lp, _, _ in known],
                [None] + [(top or [])[:k] for _, top, _ in known])


class StopMatcher:
    """Cuts the text at the first stop string (after it with `include`); holds back a tail that
    could start one."""

    def __init__(self, stops: list[str], include: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include = include
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.buffer = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string was hit)."""
        self.buffer += piece
        for s in self.stops:
            i = self.buffer.find(s)
            if i >= 0:
                out, self.buffer = self.buffer[: i + len(s) if self.include else i], ""
                return out, True
        if self.hold and len(self.buffer) > self.hold:
            out, self.buffer = self.buffer[: -self.hold], self.buffer[-self.hold :]
            return out, False
        if not self.hold:
            out, self.buffer = self.buffer, ""
            return out, False
        return "", False

    def flush(self) -> str:
        out, self.buffer = self.buffer, ""
        return out


class Gateway(RequestPreparation):
    """State shared by the endpoints: Redis, the models served (`catalog`: tokenizers, names,
    context windows), the waiting streams; how API requests become the fleet's
    (`RequestPreparation`).

    Args:
        models: the models served, the first the default (None: the default model alone).
    """

    def __init__(self, redis_url: str, models: list[ServedModel] | None = None,
                 prefix: str = "shoal") -> None:
        self.redis_url = redis_url
        self.catalog = ModelCatalog(models or [ServedModel.at(None)])
        self.keys = Keys(prefix)
        self.gateway_id = f"gw-{uuid.uuid4().hex[:8]}"
        self.channel = self.keys.tokens(self.gateway_id)
        self.queues: dict[str, asyncio.Queue[TokenEvent]] = {}
        self.redis: aioredis.Redis | None = None
        self._listener: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self._responding: set[asyncio.Task] = set()  # background responses being run
        self.max_overflow_windows = 8  # GatewaySettings.max_overflow_windows, set by create_app
        self.tool_call_parser: str | None = None  # GatewaySettings.tool_call_parser, likewise
        self.reasoning_parser: str | None = None  # GatewaySettings.reasoning_parser, likewise
        self.tracer = None  # spans of requests (shoal/tracing.py), set by create_app
        self.subscribed = False  # the token channel is live: requests may be enqueued
        self.waiting = 0  # requests in the scheduler's pool, as it last published
        self._preparer = ThreadPoolExecutor(1, thread_name_prefix="shoal-prepare")

    async def start(self) -> None:
        for model in self.catalog.models:
            await asyncio.to_thread(model.load)
        self.redis = aioredis.Redis.from_url(self.redis_url, **_CONNECTION_KWARGS)
        pubsub = await self._subscribe()
        self._listener = asyncio.create_task(self._listen(pubsub))

    async def _subscribe(self):
        """Subscribe to this gateway's token channel (before any request is enqueued) and to the
        pool's size, then read that size once: an update published meanwhile is not missed."""
        assert self.redis is not None
        pubsub = self.redis.pubsub()
        await pubsub.subscribe(self.channel, self.keys.waiting_updates)
        self.waiting = int(await self.redis.get(self.keys.waiting) or 0)
        self.subscribed = True
        return pubsub

    async def stop(self) -> None:
        # Background responses end first, each stored as failed by its task once cancelled,
        # while Redis is still there. (This relies on redis-py passing a cancel on: its 8.x
        # asyncio client swallows one that lands in a command, hence pyproject's `redis<8`.)
        for task in self._responding:
            task.cancel()
        if self._responding:
            await asyncio.wait(self._responding, timeout=STOP_RESPONSES_TIMEOUT_S)
        if self._background:  # their requests' cancels, on their way to the scheduler
            await asyncio.wait(self._background, timeout=STOP_RESPONSES_TIMEOUT_S)
        if self._listener:
            self._listener.cancel()
        if self.redis:
            await self.redis.aclose()
        self._preparer.shutdown(wait=False)

    async def prepare(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` (a `prepare_*` method, or any that tokenizes), on the gateway's preparing
        thread: a long prompt's chat template and tokenization take milliseconds (20,000 tokens
        33 ms here), a stall of every stream the event loop serves, and the tokenizer's Rust
        code runs there without the GIL, beside the loop. One thread: requests are prepared
        one at a time, in the order they came.

        Raises:
            what `fn` raises (`APIError` for a request that cannot be served)."""
        call = contextvars.copy_context().run
        return await asyncio.get_running_loop().run_in_executor(self._preparer, call, fn, *args)

    async def _listen(self, pubsub) -> None:
        """Route token events to the waiting requests; resubscribe with backoff after a Redis
        outage. Events published while the channel is down are gone, so the requests waiting
        then fail with a clear error instead of hanging, and new ones are refused (503) until it
        is back."""
        backoff = 0.1
        waiting_updates = self.keys.waiting_updates.encode()
        while True:
            try:
                if pubsub is None:
                    pubsub = await self._subscribe()
                    log.warning("resubscribed to %s after a Redis outage", self.channel)
                backoff = 0.1
                async for msg in pubsub.listen():
                    if msg.get("type") != "message":
                        continue
                    if msg["channel"] == waiting_updates:
                        self.waiting = int(msg["data"])
                        continue
                    message = decode(msg["data"])
                    # One iteration's events (TokenEvents); a lone TokenEvent from an older
                    # scheduler is read as well.
                    events = (message.events if isinstance(message, TokenEvents) else
                              [message] if isinstance(message, TokenEvent) else [])
                    for event in events:
                        q = self.queues.get(event.request_id)
                        if q is not None:
                            q.put_nowait(event)
            except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
                log.warning("token channel lost (%s); retrying in %.1f s", e, backoff)
                self.subscribed = False
                self._fail_waiting("the connection to the request queue (Redis) was lost; "
                                   "retry the request")
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
                pubsub = None
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    def _fail_waiting(self, message: str) -> None:
        for rid, q in self.queues.items():
            q.put_nowait(TokenEvent(rid, 0, [], finish_reason="error", error=message,
                                    error_status=503))

    # -- running a request ----------------------------------------------------------------------

    async def run(self, p: Prepared) -> AsyncIterator[tuple[str, TokenEvent]]:
        """Enqueue and yield (new text, event) until the request finishes.

        Text is detokenized incrementally and cut at stop strings; a stop string cancels the
        request in the fleet. Leaving the iterator early (client gone) cancels it too. The text
        of an event that brought tokens is a `Piece`: it knows where each token's text ends
        (an event holds several at `--stream-interval` > 1).
        """
        assert self.redis is not None
        q: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.queues[p.request_id] = q
        span = None if self.tracer is None else tracing.start_request_span(
            self.tracer, p.request_id, p.model.name, p.params, len(p.prompt_ids), p.priority)
        sub = RequestSubmission(p.request_id, p.model.fleet_name, p.prompt_ids, p.params, time.time(),
                                self.channel, p.priority,
                                None if span is None else tracing.carrier_of(span))
        finished: TokenEvent | None = None  # the last event, once the request has one
        t0 = time.perf_counter()
        first_token_t: float | None = None
        last_token_t: float | None = None
        next_index = 0  # tokens received
        # The model's series, looked up once rather than per token.
        ttft, itl, e2e, generated = (m.labels(p.model.name) for m in (
            metrics.TTFT, metrics.ITL, metrics.E2E, metrics.GENERATION_TOKENS))
        metrics.PROMPT_TOKENS.labels(p.model.name).inc(len(p.prompt_ids))
        metrics.ACTIVE_STREAMS.inc()
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.xadd(self.keys.requests, {"m": encode(sub)})
            await self._ring(pipe).execute()
            detok = IncrementalDetokenizer(p.model.tokenizer, p.skip_special_tokens)
            stops = StopMatcher(p.stops, p.include_stop_str)
            while True:
                ev = await q.get()
                if ev.prompt_logprobs is not None:  # no tokens: the prompt's, for echo
                    yield "", ev
                    continue
                if ev.index + len(ev.token_ids) <= next_index and ev.finish_reason is None:
                    continue  # a duplicate after a failover
                first = end = max(0, next_index - ev.index)  # tokens already had: skipped
                out, hit = "", False
                ends: list[int] = []  # where each new token's text ends in `out`
                now = time.perf_counter()
                # Token by token: an event may carry several (--stream-interval), and a stop
                # string ends the request at the token that completes it.
                while end < len(ev.token_ids) and not hit:
                    piece, hit = stops.feed(detok.add(ev.token_ids[end]))
                    out += piece
                    ends.append(len(out))
                    end += 1
                    if last_token_t is None:
                        first_token_t = now
                        ttft.observe(now - t0)
                    else:
                        itl.observe(now - last_token_t)
                    last_token_t = now
                    generated.inc()
                next_index = max(next_index, ev.index + end)
                if first or end < len(ev.token_ids):  # only the new tokens, up to a stop
                    ev = _token_slice(ev, first, end)
                if not hit and ev.finish_reason is not None:
                    piece, hit = stops.feed(detok.flush())
                    out += piece
                if hit:
                    self.cancel_soon(p.request_id)
                    finished = replace(ev, finish_reason="stop", error=None, error_status=None,
                                       completion_tokens=next_index)
                    yield Piece.of(out, ends), finished
                    return
                if ev.finish_reason is not None:
                    finished = ev
                    yield Piece.of(out + stops.flush(), ends), ev
                    return
                yield Piece.of(out, ends), ev
        finally:
            self.queues.pop(p.request_id, None)
            metrics.ACTIVE_STREAMS.dec()
            e2e_s = time.perf_counter() - t0
            if finished is not None:
                e2e.observe(e2e_s)
            else:
                self.cancel_soon(p.request_id)
            if span is not None:
                tracing.end_request_span(
                    span, finished and finished.finish_reason,
                    finished.completion_tokens if finished else next_index,
                    finished.cached_tokens if finished else 0,
                    None if first_token_t is None else first_token_t - t0, e2e_s,
                    finished.error if finished and finished.finish_reason == "error" else None)

    def _ring(self, pipe):
        """Add to `pipe` the wake-up that follows every request and cancel: the scheduler blocks
        on it (and on results) instead of polling for them. Trimmed to one entry, so it stays
        bounded while no scheduler is reading."""
        pipe.rpush(self.keys.wakeups, b"1")
        pipe.ltrim(self.keys.wakeups, 0, 0)
        return pipe

    def respond_in_background(self, run: Coroutine[Any, Any, None]) -> None:
        """Run a background response (`run`) on a task the gateway keeps until it ends, and
        cancels when the gateway stops."""
        task = asyncio.get_running_loop().create_task(run)
        self._responding.add(task)
        task.add_done_callback(self._responding.discard)

    def cancel_soon(self, request_id: str) -> None:
        """Tell the scheduler to drop a request, from a task of its own: when a client disconnects,
        the streaming response's cancel scope cancels every await of the request's own task,
        the one in its `finally` included, so the cancel must not be awaited there."""
        assert self.redis is not None
        pipe = self.redis.pipeline(transaction=False)
        pipe.rpush(self.keys.cancels, encode(Cancel(request_id)))
        task = asyncio.get_running_loop().create_task(self._ring(pipe).execute())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def check_capacity(self, max_waiting: int) -> None:
        """Refuse new work while the token channel is down or the scheduler's pool holds
        `max_waiting` requests (its size as the scheduler last published it, so no round trip).

        Raises:
            APIError: 503 while reconnecting to Redis; 429 with the pool's size when overloaded.
        """
        if not self.subscribed:
            raise APIError("the gateway is reconnecting to the request queue (Redis); retry",
                           status=503, kind="server_error")
        if self.waiting >= max_waiting:
            raise APIError(f"the fleet is overloaded: {self.waiting} requests are waiting; retry "
                           "later", status=429, kind="rate_limit_error")

    async def charge(self, api_key: str | None, tokens: int, settings: GatewaySettings) -> None:
        """Count a request against its key's per-minute budgets (fixed windows in Redis, so every
        gateway shares them). The key itself never reaches Redis, only a hash of it.

        Raises:
            APIError: 429 when a budget is spent; nothing is counted then.
        """
        if not (settings.requests_per_minute or settings.tokens_per_minute):
            return
        assert self.redis is not None
        who = hashlib.sha256((api_key or "anonymous").encode()).hexdigest()[:16]
        minute = int(time.time() // 60)
        rkey = self.keys.rate(who, "requests", minute)
        tkey = self.keys.rate(who, "tokens", minute)
        pipe = self.redis.pipeline(transaction=True)
        pipe.incrby(rkey, 1).incrby(tkey, tokens).expire(rkey, 120).expire(tkey, 120)
        used_requests, used_tokens, *_ = await pipe.execute()
        over = ((settings.requests_per_minute and used_requests > settings.requests_per_minute)
                or (settings.tokens_per_minute and used_tokens > settings.tokens_per_minute))
        if over:
            pipe = self.redis.pipeline(transaction=True)
            await pipe.decrby(rkey, 1).decrby(tkey, tokens).execute()
            raise APIError(f"rate limit reached: at most {settings.requests_per_minute or 'any'} "
                           f"requests and {settings.tokens_per_minute or 'any'} tokens (prompt + "
                           "max_tokens) per minute for this API key", status=429,
                           kind="rate_limit_error")

    async def worker_infos(self) -> list[tuple[WorkerInfo, bool]]:
        """Every registered worker's latest heartbeat (`WorkerInfo`) and whether it is alive,
        read from Redis in one round trip."""
        assert self.redis is not None
        ids = sorted(i.decode() for i in await self.redis.smembers(self.keys.workers))
        pipe = self.redis.pipeline(transaction=False)
        for wid in ids:
            pipe.hget(self.keys.worker(wid), "info")
            pipe.exists(self.keys.alive(wid))
        replies = await pipe.execute()
        return [(info, bool(alive)) for raw, alive in zip(replies[::2], replies[1::2])
                if isinstance(info := decode(raw) if raw else None, WorkerInfo)]

    async def fleet(self) -> FleetStatus:
        """The fleet as the scheduler sees it: every registered worker's latest heartbeat
        (`WorkerInfo`) and the length of the scheduler's waiting queue, read from Redis."""
        infos = await self.worker_infos()
        waiting = await self.redis.get(self.keys.waiting)
        now = time.time()
        workers = [FleetWorker(
            worker_id=info.worker_id, model=info.model, alive=alive, draining=info.draining,
            num_free_blocks=info.num_free_blocks, num_total_blocks=info.num_total_blocks,
            block_size=info.block_size, num_running=info.num_running,
            max_model_len=info.max_model_len,
            heartbeat_age_s=max(0.0, now - info.heartbeat_at) if info.heartbeat_at else None,
            loras=info.loras)
            for info, alive in infos]
        return FleetStatus(model=self.catalog.default.name,
                           models=[m.name for m in self.catalog.models],
                           num_waiting=int(waiting or 0), workers=workers)

    async def ready(self) -> tuple[bool, str]:
        """Ready when every model served has an alive worker (each model learns its context
        window from them); else why not."""
        assert self.redis is not None
        if not self.subscribed:
            return False, "not subscribed to the token channel (Redis reconnecting)"
        try:
            ids = [i.decode() for i in await self.redis.smembers(self.keys.workers)]
        except Exception as e:  # noqa: BLE001 - any Redis failure means not ready
            return False, f"redis unreachable: {e}"
        unserved = {m.name: m for m in self.catalog.models}
        for wid in ids:
            if unserved and await self.redis.exists(self.keys.alive(wid)):
                raw = await self.redis.hget(self.keys.worker(wid), "info")
                info = decode(raw) if raw else None
                model = self.catalog.served_by(info.model) if isinstance(info, WorkerInfo) else None
                if model is not None and unserved.pop(model.name, None) is not None:
                    model.max_model_len = info.max_model_len
        if unserved:
            return False, f"no alive worker serves {', '.join(unserved)}"
        return True, "ok"


REQUEST_ID_HEADER = "x-request-id"  # vLLM's, read and (with the flag) answered
# Served without a key: probes, and the pages (which send the key the user types with each call).
PUBLIC_PATHS = ("/healthz", "/health", "/ping", "/readyz", "/", "/fleet", "/shoal.css")


def _usage(prompts: list[Prepared], *last: TokenEvent) -> dict[str, Any]:
    """Usage of an API request: its prompts, each counted once however many choices it has, and
    the tokens of every choice (from each one's last event, in choice order: prompt k's choices
    are `k * n .. k * n + n - 1`). A prompt's cached tokens are those none of its choices
    computed (the fewest any of them found in the prefix cache)."""
    prompt = sum(len(p.prompt_ids) for p in prompts)
    completion = sum(ev.completion_tokens for ev in last)
    n = max(1, len(last) // len(prompts))
    cached = sum(min(ev.cached_tokens for ev in last[k * n:(k + 1) * n])
                 for k in range(len(last) // n))
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def _merge(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """The items of several async iterators as they come, each with its iterator's index.

    One iterator is read directly (no task, no queue: the one-choice request, every streamed
    token of it). Leaving early cancels the readers, which closes their iterators; an
    iterator's exception is raised here."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
    end = object()

    async def read(i: int, stream: AsyncIterator[Any]) -> None:
        try:
            async with contextlib.aclosing(stream) as it:
                async for item in it:
                    queue.put_nowait((i, item, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, raised there
            queue.put_nowait((i, end, e))
        else:
            queue.put_nowait((i, end, None))

    readers = [asyncio.create_task(read(i, st)) for i, st in enumerate(streams)]
    try:
        running = len(readers)
        while running:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is end:
                running -= 1
            else:
                yield i, item
    finally:
        for r in readers:
            r.cancel()


def _prompt_logprobs(model: ServedModel, ids: list[int], c: _Choice, k: int
                     ) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then for each one a map from
    token id to `{"logprob", "rank", "decoded_token"}` holding the prompt token and its
    position's `k` most likely tokens (ranks 1 to k)."""
    out: list[dict | None] = [None]
    for pos in range(1, len(ids)):
        lp, top, rank = c.prompt.get(pos, (None, None, None))
        if lp is None:
            out.append(None)
            continue
        entry = {str(ids[pos]): {"logprob": lp, "rank": rank, "decoded_token": model.token_text(ids[pos])}}
        for j, (t, v) in enumerate((top or [])[:k]):
            entry.setdefault(str(t), {"logprob": v, "rank": j + 1,
                                      "decoded_token": model.token_text(t)})
        out.append(entry)
    return out


def _token_name(model: ServedModel, as_token_ids: bool) -> Callable[[int], str]:
    """How logprobs name a token: its text, or `token_id:<id>` (vLLM's
    `return_tokens_as_token_ids`, for tokens whose bytes are not text alone)."""
    return (lambda t: f"token_id:{t}") if as_token_ids else model.token_text


def _reasoning_fields(thought: str | None) -> dict[str, str | None]:
    """A chat message's or delta's thinking: vLLM's `reasoning` and its older name
    `reasoning_content` (DeepSeek's API's, which many clients read), the same text."""
    return {"reasoning": thought, "reasoning_content": thought}


def _logprob_entries(name: Callable[[int], str], ids: list[int], lps: list[float | None],
                     tops: list | None) -> list[dict[str, Any]]:
    """Chat's logprobs of tokens `ids` (and the Responses API's): an entry per token, named by
    `name`, with its text's bytes and its step's alternatives (`tops`: (id, logprob) pairs per
    token; empty entries unless top_logprobs was asked for)."""
    def entry(t: int, lp: float | None) -> dict[str, Any]:
        text = name(t)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}
    return [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in top]}
            for t, lp, top in zip(ids, lps, tops or [[]] * len(ids))]


def _token_slice(ev: TokenEvent, start: int, end: int) -> TokenEvent:
    """`ev` with only its tokens `start:end` (and their logprobs)."""
    return replace(ev, index=ev.index + start, token_ids=ev.token_ids[start:end],
                   logprobs=ev.logprobs[start:end],
                   top_logprobs=None if ev.top_logprobs is None else ev.top_logprobs[start:end])


def _error_chunk(ev: TokenEvent) -> dict[str, Any]:
    """A failure inside a stream, where the HTTP status is already sent: an OpenAI error object."""
    status = ev.error_status or 503
    return APIError(ev.error or "generation failed", status=status,
                    kind="invalid_request_error" if status < 500 else "server_error").body()


def _finish(ev: TokenEvent) -> str | None:
    return "stop" if ev.finish_reason == "cancelled" else ev.finish_reason


@dataclass(frozen=True)
class GatewaySettings:
    """Limits and access rules of one gateway.

    Attributes:
        api_keys: accepted `Authorization: Bearer` keys; empty means no authentication.
        public_paths: paths served without a key.
        max_waiting: new requests get 429 while the scheduler's pool holds this many.
        max_body_bytes: larger request bodies get 413: by their Content-Length before they are
            read, else (a chunked body) once that many bytes came (Starlette's
            `RequestBodyLimitMiddleware`).
        max_file_bytes: the same for uploads to `/v1/files` (batch input files).
        retry_after_s: the Retry-After header of a 429, in seconds.
        tool_call_parser: reads the replies of tool_choice "auto" (`gateway.tools`); None
            refuses "auto", as vLLM does without --enable-auto-tool-choice.
        reasoning_parser: splits chat replies into the model's thinking and its answer
            (`gateway.reasoning`); None leaves them whole.
        max_overflow_windows: a request with `context_overflow` generates at most this many
            context windows of tokens.
        requests_per_minute, tokens_per_minute: per API key (or per gateway without keys) and
            per calendar minute, shared by every gateway through Redis; tokens count the prompt
            plus `max_tokens`. 0 means no limit.
        responses_ttl_s: seconds a stored Responses API response is kept.
        allowed_origins, allowed_methods, allowed_headers, allow_credentials: CORS, for
            browser apps on other origins (vLLM's defaults: any origin, method and header, no
            credentials). Preflight requests are answered before the API key is checked.
        enable_request_id_headers: every HTTP response carries an `X-Request-Id` header, the
            request's own or a new one (vLLM's --enable-request-id-headers).
        allow_runtime_lora_updating: serve `/v1/load_lora_adapter` and
            `/v1/unload_lora_adapter` (gateway/loras.py; vLLM's
            VLLM_ALLOW_RUNTIME_LORA_UPDATING).
    """

    api_keys: tuple[str, ...] = ()
    max_overflow_windows: int = 8
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    public_paths: tuple[str, ...] = PUBLIC_PATHS
    max_waiting: int = 1024
    max_body_bytes: int = 4 << 20
    max_file_bytes: int = 100 << 20
    retry_after_s: int = 1
    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    responses_ttl_s: int = 86400
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    enable_request_id_headers: bool = False
    allow_runtime_lora_updating: bool = False


def _key_ok(presented: str | None, keys: tuple[str, ...]) -> bool:
    """Constant-time comparison against every key (no early exit on the first match)."""
    if not presented:
        return False
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(presented.encode(), k.encode())
    return ok


def _bearer(header: str | None) -> str | None:
    if header and header.lower().startswith("bearer "):
        return header[7:].strip()
    return None


def _presented_key(headers: Headers) -> str | None:
    """The API key a request presents: `Authorization: Bearer <key>` (OpenAI's clients), else
    `x-api-key` (Anthropic's)."""
    return _bearer(headers.get("authorization")) or headers.get("x-api-key")


def _error_response(path: str, e: APIError, headers: dict[str, str] | None = None
                    ) -> JSONResponse:
    """An error as the API of `path` answers it: Anthropic's body on its Messages API, TGI's
    (and its 422 for a request that is not valid) on TGI's, OpenAI's everywhere else."""
    if tgi.owns(path):
        status = tgi.status_of(e.status)
        return JSONResponse(tgi.error_body(status, str(e), e.param), status_code=status,
                            headers=headers)
    body = anthropic.error_body(e.status, str(e)) if anthropic.owns(path) else e.body()
    return JSONResponse(body, status_code=e.status, headers=headers)


class _Guard:
    """Authentication and the body-size limit, before any route runs (ASGI middleware)."""

    def __init__(self, app: ASGIApp, settings: GatewaySettings) -> None:
        self.app, self.settings = app, settings
        # A body with a Content-Length past the limit is refused here, before it is read, with
        # our error body. One without (chunked) goes through Starlette's limit, which cuts it
        # as it comes and raises the 413 our handler answers (the uploads route raises the
        # limit to --max-file-bytes). Only those requests pay for its layer, which a streamed
        # response would cross with every chunk; FastAPI's app-wide limit would also sit
        # outermost and answer in plain text.
        self.limited = RequestBodyLimitMiddleware(app, settings.max_body_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            refusal = self._refusal(scope, headers)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
            if "content-length" not in headers:
                await self.limited(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope, headers: Headers) -> JSONResponse | None:
        settings, path = self.settings, scope["path"]
        # The public paths are pages and probes; POST / is TGI's API.
        public = path in settings.public_paths and scope["method"] in ("GET", "HEAD")
        if settings.api_keys and not public and not _key_ok(
                _presented_key(headers), settings.api_keys):
            return _error_response(path, APIError(
                "missing or invalid API key (Authorization: Bearer <key>, or x-api-key: <key>)",
                status=401, code="invalid_api_key"))
        length = headers.get("content-length")
        if length and length.isdigit() and int(length) > _body_limit(settings, path):
            return _error_response(path, _too_large(settings, path))
        return None


def _body_limit(settings: GatewaySettings, path: str) -> int:
    """The most bytes a request body to `path` may have."""
    return settings.max_file_bytes if path == FILES_PATH else settings.max_body_bytes


def _too_large(settings: GatewaySettings, path: str) -> APIError:
    return APIError(f"the request body exceeds {_body_limit(settings, path)} bytes", status=413)


class _TraceContext:
    """The client's W3C trace context (`traceparent`), when its request carries one, made the
    current context while the request runs: the spans the request starts are its children
    (ASGI middleware, added only when the gateway traces)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = Headers(scope=scope) if scope["type"] in ("http", "websocket") else {}
        carrier = {h: headers[h] for h in tracing.TRACE_HEADERS if h in headers}
        if not carrier:
            await self.app(scope, receive, send)
            return
        from opentelemetry import context

        token = context.attach(tracing.context_of(carrier))
        try:
            await self.app(scope, receive, send)
        finally:
            context.detach(token)


def _flat_routes(routes: list) -> Iterator[Route]:
    """Every route, those of included routers too (recent FastAPI keeps an included router as
    one entry, `original_router` holding its routes; its includes here add no prefix)."""
    for route in routes:
        if isinstance(route, Route):
            yield route
        elif (inner := getattr(route, "original_router", None)) is not None:
            yield from _flat_routes(inner.routes)


def _reply_id(kind: str, request: Request, req: GenerationRequest, fleet_id: str) -> str:
    """The id of a completions (`kind` "cmpl") or chat ("chatcmpl") reply: `<kind>-<id>` for the
    client's id, from its `X-Request-Id` header or else the body's `request_id` (vLLM's order),
    and `fleet_id` without one. The fleet keeps ids of its own for the requests: two clients
    sending the same id must not cancel or receive each other's tokens.

    Raises:
        APIError: the header's id is longer than MAX_REQUEST_ID_CHARS.
    """
    client_id = request.headers.get(REQUEST_ID_HEADER) or req.request_id
    if not client_id:
        return fleet_id
    if len(client_id) > MAX_REQUEST_ID_CHARS:
        raise APIError(f"X-Request-Id is longer than {MAX_REQUEST_ID_CHARS} characters",
                       param="X-Request-Id")
    return f"{kind}-{client_id}"


class _ResponseStartHook:
    """ASGI middleware over HTTP requests that looks at (and may change) each response's start:
    `begin(scope)` makes the request's state, `on_start(state, message)` sees the
    `http.response.start` message, `end(scope, state)` runs when the request is done."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    def begin(self, scope: Scope) -> Any:
        return None

    def on_start(self, state: Any, message: Message) -> None:
        pass

    def end(self, scope: Scope, state: Any) -> None:
        pass

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = self.begin(scope)

        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.on_start(state, message)
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            self.end(scope, state)


class _RequestIdHeader(_ResponseStartHook):
    """vLLM's --enable-request-id-headers: each HTTP response carries `X-Request-Id`, the
    request's own when it sent one, else a new one."""

    def begin(self, scope: Scope) -> str:
        return Headers(scope=scope).get(REQUEST_ID_HEADER) or uuid.uuid4().hex

    def on_start(self, state: str, message: Message) -> None:
        MutableHeaders(scope=message)[REQUEST_ID_HEADER] = state


class _CountRequests(_ResponseStartHook):
    """`shoal_gateway_requests_total` by route and status."""

    def begin(self, scope: Scope) -> list[int]:
        return []  # the response's status, once it starts

    def on_start(self, state: list[int], message: Message) -> None:
        state.append(message["status"])

    def end(self, scope: Scope, state: list[int]) -> None:
        if state:  # the router has put the matched route into the shared scope
            endpoint = getattr(scope.get("route"), "path", None) or "other"
            metrics.REQUESTS.labels(endpoint, str(state[0])).inc()


def create_app(redis_url: str, models: list[ServedModel] | None = None, prefix: str = "shoal",
               settings: GatewaySettings | None = None, tracer: Any = None) -> FastAPI:
    """The gateway's FastAPI application, serving `models` (None: the default model); with a
    `tracer` (shoal/tracing.py), every request in the fleet gets a span."""
    settings = settings or GatewaySettings()
    gw = Gateway(redis_url, models, prefix)
    gw.max_overflow_windows = settings.max_overflow_windows
    gw.tool_call_parser = settings.tool_call_parser
    gw.reasoning_parser = settings.reasoning_parser
    gw.tracer = tracer

    runtime_loras = RuntimeLoRAs(gw)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await gw.start()
        learning = asyncio.create_task(runtime_loras.refresh_forever())
        freeze_heap()
        yield
        learning.cancel()
        await gw.stop()

    app = FastAPI(title="shoal gateway", lifespan=lifespan)
    app.state.gateway = gw

    app.include_router(pages_router(gw.fleet, FleetStatus, error_responses))
    jobs = Jobs(redis_url, prefix, {"completions": CompletionRequest, "chat": ChatRequest,
                                    "responses": ResponsesRequest}, APIError)
    app.include_router(jobs_router(jobs, error_responses))
    app.include_router(batches_router(jobs, error_responses, settings.max_file_bytes))
    app.include_router(loras_router(runtime_loras, settings.allow_runtime_lora_updating,
                                    error_responses))

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        headers = {"Retry-After": str(settings.retry_after_s)} if e.status == 429 else None
        return _error_response(request.url.path, e, headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        # Starlette's own errors (an unparsable body, 404 and 405 on unknown routes) get the
        # error body of ours.
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        headers = getattr(e, "headers", None)
        if e.status_code == 413:  # a chunked body cut by the limit, as the guard words it
            return _error_response(request.url.path, _too_large(settings, request.url.path))
        if e.status_code == 405:
            # Starlette's Allow names the methods of the first route whose path matches; a
            # path served by a route per method (GET and DELETE /v1/responses/{id}) allows all.
            allowed = {m for route in _flat_routes(app.router.routes)
                       if route.matches(request.scope)[0] == Match.PARTIAL
                       for m in route.methods or ()}
            headers = {**(headers or {}), "Allow": ", ".join(sorted(allowed))}
        return _error_response(request.url.path,
                               APIError(str(e.detail), status=e.status_code, kind=kind), headers)

    @app.exception_handler(redis.RedisError)
    async def _redis_error(request: Request, e: redis.RedisError):
        return _error_response(request.url.path, APIError(
            f"the request queue (Redis) is unavailable: {e}", status=503, kind="server_error"))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return _error_response(request.url.path, invalid_request(e.errors()))

    # Plain ASGI middleware, not `@app.middleware("http")`: Starlette's BaseHTTPMiddleware relays
    # every chunk of a streamed response through a memory stream and a task group, per layer,
    # which made the gateway's CPU time per streamed token the largest part of its load.
    app.add_middleware(_Guard, settings=settings)
    if tracer is not None:
        app.add_middleware(_TraceContext)
    # Outside the guard: a browser's preflight carries no API key.
    app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins,
                       allow_methods=settings.allowed_methods,
                       allow_headers=settings.allowed_headers,
                       allow_credentials=settings.allow_credentials)
    if settings.enable_request_id_headers:
        app.add_middleware(_RequestIdHeader)
    app.add_middleware(_CountRequests)  # outermost: counts the guard's refusals too

    @app.get("/metrics", responses={200: {"content": {"text/plain": {}}}, **error_responses(401)})
    async def prometheus_metrics():
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    async def admit(ps: list[Prepared], key: str | None) -> None:
        """Overload and per-key rate limits (`key`: the API key presented), checked before a
        request (its choices) is enqueued."""
        gw.check_capacity(settings.max_waiting)
        await gw.charge(key, sum(len(p.prompt_ids) + p.params.max_tokens for p in ps), settings)

    @app.get("/healthz")
    @app.get("/health", description="vLLM's name for /healthz")
    @app.get("/ping", description="SageMaker's name for /healthz, as vLLM serves it")
    @app.post("/ping", description="SageMaker's name for /healthz, as vLLM serves it")
    async def healthz():
        return {"status": "ok"}

    @app.get("/version", responses=error_responses(401))
    async def version():
        return {"version": shoal.__version__}

    @app.get("/readyz", responses={503: {"description": "not ready: no worker or no Redis"}})
    async def readyz():
        ok, why = await gw.ready()
        return JSONResponse({"status": "ok" if ok else "unavailable", "detail": why},
                            status_code=200 if ok else 503)

    def model_card(name: str) -> dict[str, Any]:
        """A model as vLLM lists it: OpenAI's fields, its file (`root`) and context window; a
        LoRA adapter's `root` is its directory and its `parent` the base model."""
        model = gw.catalog.get(name)
        root, parent = (str(model.path), None) if model.lora is None else \
            (str(model.adapter_path), model.fleet_name)
        return {"id": name, "object": "model", "created": 0, "owned_by": "shoal",
                "root": root, "parent": parent, "max_model_len": model.max_model_len}

    @app.get("/v1/models", responses=error_responses(401))
    async def models():
        return {"object": "list", "data": [model_card(name) for name in gw.catalog.names]}

    @app.get("/v1/models/{model:path}", responses=error_responses(401, 404))
    async def model(model: str):
        """OpenAI's: one model by name (a name may hold slashes)."""
        return model_card(model)

    @app.post("/tokenize", responses=error_responses(400, 401, 404))
    async def tokenize(req: TokenizeRequest):
        """vLLM's: the token ids a completions prompt or a chat's messages would be sent as."""
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give either prompt or messages", param="prompt")
        model = gw.catalog.get(req.model)
        ids = await (gw.prepare(model.chat_ids, req.messages) if req.messages is not None
                     else gw.prepare(model.prompt_ids, req.prompt))
        return {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids}

    @app.post("/detokenize", responses=error_responses(400, 401, 404))
    async def detokenize(req: DetokenizeRequest):
        """vLLM's: the text of token ids."""
        model = gw.catalog.get(req.model)
        model.check_token_ids(req.tokens, "tokens")
        return {"prompt": model.decode(req.tokens)}

    async def _collect(ps: list[Prepared]) -> list[_Choice]:
        """Every choice run to its end; the first failure raises (and cancels the others)."""
        out = [_Choice() for _ in ps]
        async with contextlib.aclosing(_merge([gw.run(p) for p in ps])) as events:
            async for i, (piece, ev) in events:
                c = out[i]
                if ev.prompt_logprobs is not None:
                    c.score(ev)
                    continue
                c.text += piece
                c.ids += ev.token_ids
                if ps[i].reasoning is not None:  # counts the thinking's tokens
                    ps[i].reasoning.feed(i, piece, ev.finish_reason is not None,
                                         len(ev.token_ids))
                c.logprobs += ev.logprobs
                c.tops += ev.top_logprobs or []
                c.last = ev
                if ev.finish_reason == "error":
                    status = ev.error_status or 503
                    raise APIError(ev.error or "generation failed", status=status,
                                   kind="invalid_request_error" if status < 500 else "server_error")
        return out

    async def _chunks(prompts: list[Prepared], ps: list[Prepared], base: dict, req: GenerationRequest,
                      choice: Callable[[int, str, TokenEvent], dict],
                      first: Callable[[int], dict] | None = None,
                      usage: Callable[..., dict] | None = None) -> AsyncIterator[ChunkGroup]:
        """The stream's chunks, grouped as `EventStream` writes them: `choice(index, text,
        event)` shapes each one (completions and chat differ only there), `first(index)` opens
        each choice; a failure becomes an error object and ends the stream; the event that ends
        the last open choice ends it too, with usage over all choices if asked for (`usage` of
        the last events, `_usage` by default). `choice`
        may return None for an event that makes no chunk (prompt logprobs still coming). With
        vLLM's `continuous_usage_stats`, each chunk carries its choice's usage so far."""
        options = req.stream_options
        continuous = bool(options and options.include_usage and options.continuous_usage_stats)
        generated = [0] * len(ps)  # tokens so far, by choice

        def with_usage(i: int, chunk: dict[str, Any]) -> dict[str, Any]:
            if not continuous:
                return chunk
            prompt = len(ps[i].prompt_ids)
            return {**chunk, "usage": {"prompt_tokens": prompt, "completion_tokens": generated[i],
                                       "total_tokens": prompt + generated[i]}}

        if first is not None:
            yield [with_usage(i, first(i)) for i in range(len(ps))], False
        last: dict[int, TokenEvent] = {}
        async with contextlib.aclosing(_merge([gw.run(p) for p in ps])) as events:
            async for i, (piece, ev) in events:
                if ev.finish_reason == "error":
                    yield [_error_chunk(ev)], True
                    return
                if ev.finish_reason:
                    last[i] = ev
                generated[i] = max(generated[i], ev.index + len(ev.token_ids))
                # A token whose text the detokenizer holds back still gets a chunk when its
                # logprob was asked for.
                shaped = (choice(i, piece, ev)
                          if piece or ev.finish_reason or ev.prompt_logprobs is not None
                          or ev.logprobs and ev.logprobs[0] is not None else None)
                group = [with_usage(i, {**base, "choices": [shaped]})] if shaped is not None \
                    else []
                if len(last) == len(ps):
                    if req.stream_options and req.stream_options.include_usage:
                        group.append({**base, "choices": [], "usage": (usage or partial(
                            _usage, prompts))(*(last[k] for k in sorted(last)))})
                    yield group, True
                    return
                if group:
                    yield group, False

    @app.post("/v1/completions", responses=GENERATION_RESPONSES)
    async def completions(req: CompletionRequest, request: Request):
        rid, prompts = await gw.prepare(gw.prepare_completion, req)
        rid = _reply_id("cmpl", request, req, rid)
        ps = gw.choices(prompts, req.n)
        await admit(ps, _presented_key(request.headers))
        created = int(time.time())
        model = ps[0].model
        base = {"id": rid, "object": "text_completion", "created": created, "model": model.name}

        def logprobs(ids: list[int], lps: list, tops: list | None, start: int = 0) -> dict | None:
            """The legacy completions form: parallel lists, each step's alternatives as a map
            from token text to logprob, and each token's offset in the choice's text (`start`
            for the first; the token texts' lengths after it, as vLLM counts)."""
            if req.logprobs is None:
                return None
            texts = [model.token_text(t) for t in ids]
            name = _token_name(model, req.return_tokens_as_token_ids)
            return {"tokens": [name(t) for t in ids] if req.return_tokens_as_token_ids else texts,
                    "token_logprobs": lps,
                    "top_logprobs": [None if top is None else {name(t): lp for t, lp in top}
                                     for top in tops] if req.logprobs and tops else None,
                    "text_offset": list(itertools.accumulate(map(len, texts[:-1]), initial=start))
                    if texts else []}

        if req.stream:
            offsets = [0] * len(ps)  # each choice's next token's text offset
            # With echo, each choice's prompt scores until its prompt is sent (then None).
            unechoed: list[_Choice | None] = [_Choice() if req.echo else None for _ in ps]

            def chunk(i: int, piece: str, ev: TokenEvent) -> dict[str, Any] | None:
                ids, lps, tops = ev.token_ids, ev.logprobs, ev.top_logprobs
                prompt = unechoed[i]
                if ev.prompt_logprobs is not None:
                    if prompt is None:
                        return None  # a prompt recomputed after its echo was sent
                    prompt.score(ev)
                    if not prompt.scored(len(ps[i].prompt_ids)):
                        return None
                if prompt is not None:
                    # The prompt opens the choice, as vLLM streams echo: alone once it is
                    # scored, else with the first generated text.
                    unechoed[i] = None
                    piece = model.decode(ps[i].prompt_ids) + piece
                    if req.logprobs is not None:
                        pids, plps, ptops = prompt.echo(ps[i].prompt_ids, req.logprobs)
                        ids, lps = pids + list(ids), plps + list(lps)
                        tops = ptops + list(tops or [None] * len(ev.token_ids))
                lp = logprobs(ids, lps, tops, offsets[i])
                if lp is not None:
                    offsets[i] += sum(map(len, lp["tokens"]))
                return {"index": i, "text": piece, "logprobs": lp, "finish_reason": _finish(ev)}
            return EventStream(_chunks(prompts, ps, base, req, chunk))
        done = await _collect(ps)
        if req.echo:  # the prompt first
            for p, c in zip(ps, done):
                c.text = model.decode(p.prompt_ids) + c.text
                if req.logprobs is not None:
                    ids, lps, tops = c.echo(p.prompt_ids, req.logprobs)
                    c.ids[:0], c.logprobs[:0], c.tops[:0] = ids, lps, tops

        def choice(i: int, p: Prepared, c: _Choice) -> dict[str, Any]:
            out = {"index": i, "text": c.text, "logprobs": logprobs(c.ids, c.logprobs, c.tops),
                   "finish_reason": _finish(c.last)}
            if req.prompt_logprobs is not None:
                out["prompt_logprobs"] = _prompt_logprobs(model, p.prompt_ids, c, req.prompt_logprobs)
            return out
        return {**base, "choices": [choice(i, p, c) for i, (p, c) in enumerate(zip(ps, done))],
                "usage": _usage(prompts, *(c.last for c in done))}

    async def chat_reply(req: ChatRequest, rid: str, prompts: list[Prepared], request: Request):
        """The reply to chat `prompts` (one conversation, with `req.n` choices; or a batch of
        conversations, one choice each), streamed or whole, with the id `rid`."""
        p = prompts[0]
        ps = gw.choices(prompts, req.n)
        await admit(ps, _presented_key(request.headers))
        created = int(time.time())
        base = {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": p.model.name}

        def logprobs(ids: list[int], lps: list, tops: list | None) -> dict | None:
            if not req.logprobs:
                return None
            return {"content": _logprob_entries(
                _token_name(p.model, req.return_tokens_as_token_ids), ids, lps, tops)}

        tools, reasoning = p.tools, p.reasoning

        def usage(*last: TokenEvent) -> dict[str, Any]:
            counts = _usage(prompts, *last)
            if reasoning is not None:  # the choices' thinking, counted as it came
                counts["completion_tokens_details"] = {"reasoning_tokens": sum(
                    q.reasoning.thinking_tokens(i) for i, q in enumerate(ps))}
            return counts
        if req.stream:
            texts = [""] * len(ps)  # each choice's content so far (tool calls are built from it)

            def chunk(i: int, piece: str, ev: TokenEvent) -> dict[str, Any]:
                reason = _finish(ev)
                delta: dict[str, Any] = {}
                if reasoning is not None:  # the thinking goes first, the rest is content
                    thought, piece = reasoning.feed(i, piece, reason is not None,
                                                    len(ev.token_ids))
                    if thought:
                        delta = _reasoning_fields(thought)
                if tools is not None:
                    texts[i] += piece
                    delta |= tools.delta(i, piece, texts[i], reason is not None) or {}
                    reason = tools.finish_reason(reason, tools.called(i))
                elif piece:
                    delta["content"] = piece
                return {"index": i, "delta": delta,
                        "logprobs": logprobs(ev.token_ids, ev.logprobs, ev.top_logprobs),
                        "finish_reason": reason}
            return EventStream(_chunks(prompts, ps, base, req, chunk, first=lambda i: {
                **base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                     "finish_reason": None}]}, usage=usage))
        done = await _collect(ps)

        def choice(i: int, c: _Choice) -> dict[str, Any]:
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            reason = _finish(c.last)
            if reasoning is not None:
                thought, message["content"] = reasoning.split(c.text)
                message |= _reasoning_fields(thought)
            if tools is not None:
                calls, message["content"] = tools.message(i, message["content"] or "")
                if calls:
                    message["tool_calls"] = calls
                reason = tools.finish_reason(reason, calls)
            if reasoning is not None and not message["content"]:
                message["content"] = None  # all thinking (or all calls)
            return {"index": i, "message": message,
                    "logprobs": logprobs(c.ids, c.logprobs, c.tops), "finish_reason": reason}
        prompt_logprobs = ({"prompt_logprobs": _prompt_logprobs(p.model, p.prompt_ids, done[0],
                                                                req.prompt_logprobs)}
                           if req.prompt_logprobs is not None else {})
        return {**base, "object": "chat.completion",
                "choices": [choice(i, c) for i, c in enumerate(done)], **prompt_logprobs,
                "usage": usage(*(c.last for c in done))}

    @app.post("/v1/chat/completions", responses=GENERATION_RESPONSES)
    async def chat(req: ChatRequest, request: Request):
        p = await gw.prepare(gw.prepare_chat, req)
        return await chat_reply(req, _reply_id("chatcmpl", request, req, p.request_id), [p],
                                request)

    @app.post("/v1/chat/completions/batch", responses=error_responses(400, 401, 404, 429, 503))
    async def chat_batch(req: BatchChatRequest, request: Request):
        """vLLM's: several conversations in one request, choice k answering conversation k."""
        rid, prompts = await gw.prepare(gw.prepare_chat_batch, req)
        return await chat_reply(req, _reply_id("chatcmpl", request, req, rid), prompts, request)

    @app.post("/invocations", responses=GENERATION_RESPONSES, openapi_extra={"requestBody": {
        "required": True, "content": {"application/json": {"schema": {"oneOf": [
            {"$ref": "#/components/schemas/ChatRequest"},
            {"$ref": "#/components/schemas/CompletionRequest"}]}}}}})
    async def invocations(request: Request):
        """SageMaker's inference route, as vLLM serves it: a chat request (it has `messages`)
        or a completions request (`prompt`), answered as on its own route."""
        try:
            body = await request.json()
        except ValueError as e:
            raise APIError(f"the request body is not valid JSON: {e}") from e
        if not isinstance(body, dict) or not ({"messages", "prompt"} & body.keys()):
            raise APIError("expected a chat request (with messages) or a completions request "
                           "(with prompt)")
        kind = ChatRequest if "messages" in body else CompletionRequest
        try:
            req = kind.model_validate(body)
        except ValidationError as e:
            raise invalid_request(e.errors()) from e
        return await (chat(req, request) if kind is ChatRequest else completions(req, request))

    store = ResponseStore(lambda: gw.redis, gw.keys, settings.responses_ttl_s)

    @app.post("/v1/responses", responses=RESPONSES_RESPONSES)
    async def responses(req: ResponsesRequest, request: Request):
        """OpenAI's Responses API, served as a chat request (gateway/responses.py)."""
        req.check_background()
        history = await store.history(req.previous_response_id) \
            if req.previous_response_id else []
        items = [*history, *req.items()]
        with responses_refusals():
            p = await prepare_response(req, items)
        await admit([p], _presented_key(request.headers))
        name = _token_name(p.model, False)
        shape = ResponseShape(req, p.model.name, p.tools, lambda ev: _logprob_entries(
            name, ev.token_ids, ev.logprobs, ev.top_logprobs), p.reasoning)

        async def keep(response: dict[str, Any], quiet: bool = False) -> None:
            if req.store:
                await store.save(response, items, quiet)
        if req.background:
            queued = shape.body("", None, None, queued=True)
            await store.save(queued, items, runner={"channel": gw.channel,
                                                    "request_id": p.request_id},
                             logged=req.stream)
            gw.respond_in_background(run_in_background(p, shape, req.stream))
            if req.stream:  # from the log, as a client that reconnects reads it
                return TypedEventStream(store.replay(shape.id, None, gw.cancel_soon))
            return queued
        if req.stream:
            return TypedEventStream(shape.events(gw.run(p), lambda last: _usage([p], last),
                                                 lambda response: keep(response, quiet=True)))
        done = (await _collect([p]))[0]
        # The message's logprobs are its answer's: the thinking's tokens (a reasoning item's)
        # are left out.
        skip = p.reasoning.thinking_tokens(0) if p.reasoning is not None else 0
        response = shape.body(done.text, done.last, _usage([p], done.last),
                              logprobs=_logprob_entries(name, done.ids[skip:],
                                                        done.logprobs[skip:], done.tops[skip:])
                              if shape.logprobs else None)
        await keep(response)
        return response

    async def prepare_response(req: ResponsesRequest, items: list[Any]) -> Prepared:
        """The chat request a response answers, over the conversation `items`; with
        `truncation: "auto"`, over what is left of them once the oldest that do not fit the
        context window are dropped (`truncated`).

        Raises:
            APIError: as `prepare_chat`: the conversation does not fit (`PromptTooLong`, also
                once "auto" has dropped all but its last item), and the rest."""
        while True:
            try:
                return await gw.prepare(gw.prepare_chat, req.to_chat(items))
            except PromptTooLong:
                if req.truncation != "auto" or (items := truncated(items)) is None:
                    raise

    async def run_in_background(p: Prepared, shape: ResponseShape, streamed: bool) -> None:
        """A background response's request run to its end, the response stored in progress at
        its first token and finished at its end (`ResponseStore.settle`: never over a cancel,
        though a cancelled run's own object, with its output so far, replaces the bare one
        the cancel stored); `streamed`, its events logged as they are made
        (`ResponseStore.log_events`). The gateway stopping, or Redis failing, stores it failed
        (and ends its log with `response.failed`)."""
        logged = -1  # the sequence number of the last event logged
        stopped: dict[str, Any] | None = None  # the stored object of a run stopped at its start

        async def started(run: AsyncIterator[tuple[str, TokenEvent]]):
            """`run`, the response stored in progress at its first token; stopped there when
            it was cancelled (or found failed) first, or deleted: a cancel that reached the
            scheduler before the request did found nothing to cancel."""
            nonlocal stopped
            first = True
            async with contextlib.aclosing(run) as events:  # leaving it cancels the request
                async for piece, ev in events:
                    if first:
                        first = False
                        stored = await store.settle(shape.body("", None, None),
                                                    unless=(*TERMINAL, "in_progress"))
                        if ev.finish_reason is None and (stored is None
                                                         or stored["status"] in TERMINAL):
                            stopped = stored or shape.failed("the response was deleted")
                            return
                    yield piece, ev

        async def finish(final: dict[str, Any]) -> None:
            unless = tuple(s for s in TERMINAL if s != "cancelled") \
                if final["status"] == "cancelled" else TERMINAL
            await store.settle(final, unless)

        try:
            if streamed:
                groups = shape.events(started(gw.run(p)), lambda last: _usage([p], last), finish,
                                      queued=True)
                async with contextlib.aclosing(groups):
                    async for group, _ in groups:
                        await store.log_events(shape.id, group, create=logged < 0)
                        logged = group[-1]["sequence_number"]
                if stopped is not None:  # the log ends as the response stands
                    await store.end_log(shape.id, stopped)
            else:
                text, last, logprobs = "", None, []
                async with contextlib.aclosing(started(gw.run(p))) as pieces:
                    async for piece, ev in pieces:
                        text, last = text + piece, ev
                        if shape.logprobs is not None and ev.token_ids:
                            logprobs += shape.logprobs(ev)
                if stopped is None:
                    await finish(shape.body(text, last, _usage([p], last), logprobs=logprobs))
        except asyncio.CancelledError:
            with contextlib.suppress(redis.RedisError):
                await fail_response(shape, streamed, "the gateway stopped before the response "
                                    "finished")
            raise
        except redis.RedisError as e:
            log.warning("background response %s lost Redis: %s", shape.id, e)
            try:
                await fail_response(shape, streamed, "the gateway lost Redis while running the "
                                    f"response: {e}")
            except redis.RedisError:
                log.warning("background response %s not stored: Redis failed", shape.id,
                            exc_info=True)

    async def fail_response(shape: ResponseShape, streamed: bool, message: str) -> None:
        """Store a background response failed for the gateway's sake (`message`), unless it
        has ended, and end its log (`streamed`) as it stands."""
        failed = shape.failed(message)
        stored = await store.settle(failed) or failed
        if streamed:
            await store.end_log(shape.id, stored)

    @app.get("/v1/responses/{response_id}", responses={
        **error_responses(400, 401, 404),
        200: {"content": {"application/json": {}, "text/event-stream": {}}}})
    async def get_response(response_id: str, stream: bool = False,
                           starting_after: Annotated[int | None, Query(ge=0)] = None):
        """A stored response (a background one as it stands), or with `stream` a streamed
        background response's events (those after the sequence number `starting_after`), from
        its first to its last, however far it has come."""
        record = await store.load(response_id)
        if not stream:
            if starting_after is not None:
                raise APIError("starting_after is a position in the response's stream: "
                               "ask for stream=true", param="starting_after")
            return await store.current(record, gw.cancel_soon)
        if not record.get("logged"):
            raise APIError("only a background response created with stream: true can be "
                           "streamed again", param="stream")
        return TypedEventStream(store.replay(response_id, starting_after, gw.cancel_soon))

    @app.post("/v1/responses/{response_id}/cancel", responses=error_responses(400, 401, 404))
    async def cancel_response(response_id: str):
        """Cancel a background response that is queued or in progress: it is stored cancelled
        and its request is cancelled in the fleet, whichever gateway runs it. Cancelling a
        cancelled response returns it again; any other finished one is a 400."""
        record = await store.load(response_id)
        if "runner" not in record:
            raise APIError("only background responses can be cancelled", param="response_id")
        response = await store.current(record, gw.cancel_soon)
        if response["status"] not in TERMINAL:
            settled = await store.settle({**response, "status": "cancelled"})
            if settled is None:  # deleted meanwhile
                raise APIError(f"no response {response_id!r} is stored", status=404,
                               param="response_id")
            if settled["status"] == "cancelled":
                gw.cancel_soon(record["runner"]["request_id"])
            response = settled
        if response["status"] != "cancelled":
            raise APIError(f"the response is {response['status']}: only a queued or "
                           "in-progress response can be cancelled", param="response_id")
        return response

    @app.delete("/v1/responses/{response_id}", responses=error_responses(401, 404))
    async def delete_response(response_id: str):
        """Delete a stored response and its events. A background response still running is
        cancelled too: nothing could read it any more."""
        record = await store.load(response_id)
        if "runner" in record and record["response"]["status"] not in TERMINAL:
            gw.cancel_soon(record["runner"]["request_id"])
        if not await store.delete(response_id):
            raise APIError(f"no response {response_id!r} is stored", status=404,
                           param="response_id")
        return {"id": response_id, "object": "response", "deleted": True}

    @app.get("/v1/responses/{response_id}/input_items", responses=error_responses(400, 401, 404))
    async def response_input_items(response_id: str,
                                   limit: Annotated[int, Query(ge=1, le=100)] = 20,
                                   after: str | None = None,
                                   order: Literal["asc", "desc"] = "desc"):
        """The input items a stored response answered (a previous response's included), as
        OpenAI lists them: newest first by default, `limit` at a time after the item
        `after`."""
        items = (await store.load(response_id))["input"]
        items = items[::-1] if order == "desc" else items
        ids = [item["id"] for item in items]
        if after is not None:
            if after not in ids:
                raise APIError(f"no input item {after!r} in this response", param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}

    @app.post(anthropic.PATH, responses=anthropic.MESSAGES_RESPONSES)
    async def messages(req: anthropic.MessagesRequest, request: Request):
        """Anthropic's Messages API, served as a chat request (gateway/anthropic.py)."""
        with anthropic.refusals():
            p = await gw.prepare(gw.prepare_chat, req.to_chat())
        await admit([p], _presented_key(request.headers))
        shape = anthropic.MessageShape(req, p.model.name, p.tools, len(p.prompt_ids),
                                       p.reasoning)
        if req.stream:
            return TypedEventStream(shape.events(gw.run(p), lambda last: _usage([p], last)))
        done = (await _collect([p]))[0]
        return shape.body(done.text, done.last, _usage([p], done.last))

    async def generate(req: tgi.GenerateRequest, request: Request, stream: bool):
        """TGI's generation, served as a completions request (gateway/tgi.py): its stream, or
        its answer."""
        with tgi.refusals():
            _, (p,) = await gw.prepare(gw.prepare_completion, req.to_completion(stream))
        await admit([p], _presented_key(request.headers))
        shape = tgi.GenerationShape(req, p.model, p.prompt_ids,
                                    p.params.seed if req.parameters.sampling else None)
        if stream:
            return DataEventStream(shape.events(gw.run(p)))
        c = (await _collect([p]))[0]
        answer: dict[str, Any] = {"generated_text": shape.generated_text(c.text)}
        if req.parameters.details:
            prefill = shape.prefill(lambda pos: c.prompt.get(pos, (None,))[0])
            answer["details"] = shape.details(c.text, c.last, c.ids, c.logprobs, c.tops, prefill)
        return answer

    @app.post("/generate", responses=tgi.GENERATE_RESPONSES)
    async def tgi_generate(req: tgi.GenerateRequest, request: Request):
        """TGI's: the generated text (with `details`, how it was made)."""
        return await generate(req, request, stream=False)

    @app.post("/generate_stream", responses=tgi.STREAM_RESPONSES)
    async def tgi_generate_stream(req: tgi.GenerateRequest, request: Request):
        """TGI's: the generated tokens as they come."""
        return await generate(req, request, stream=True)

    @app.post("/", responses=tgi.STREAM_RESPONSES)
    async def tgi_compat(req: tgi.GenerateRequest, request: Request):
        """TGI's compatibility route: the stream with `stream: true`, else a list of one
        answer."""
        answer = await generate(req, request, stream=req.stream)
        return answer if req.stream else [answer]

    @app.get("/info", responses=error_responses(401))
    async def tgi_info():
        """TGI's: the model served (the default one) and the gateway's limits."""
        return tgi.info(gw.catalog.default, shoal.__version__)

    @app.post(anthropic.PATH + "/count_tokens", responses=anthropic.COUNT_TOKENS_RESPONSES)
    async def count_tokens(req: anthropic.CountTokensRequest):
        """Anthropic's: the prompt tokens a Messages request of this conversation would have."""
        with anthropic.refusals():
            return {"input_tokens": len((await gw.prepare(gw.chat_prompt,
                                                          req.chat_request()))[1])}

    @app.websocket("/v1/stream")
    async def stream(ws: WebSocket):
        if settings.api_keys and not _key_ok(
                _presented_key(ws.headers) or ws.query_params.get("api_key"),
                settings.api_keys):
            metrics.REQUESTS.labels("/v1/stream", "401").inc()
            await ws.close(code=1008, reason="missing or invalid API key")  # before accepting
            return
        await ws.accept()
        try:
            body = await ws.receive_json()
            try:
                prompts = ([await gw.prepare(gw.prepare_chat, ChatRequest(**body))]
                           if "messages" in body else
                           (await gw.prepare(gw.prepare_completion, CompletionRequest(**body)))[1])
            except ValidationError as e:
                raise invalid_request(e.errors()) from e
            if body.get("n", 1) != 1 or len(prompts) != 1:
                raise APIError("one prompt and one choice (n = 1) per WebSocket stream", param="n")
            p = prompts[0]
            await admit([p], _presented_key(ws.headers) or ws.query_params.get("api_key"))
            index = 0
            async with contextlib.aclosing(gw.run(p)) as events:
                async for piece, ev in events:
                    for t in ev.token_ids:
                        await ws.send_json({"type": "token", "index": index, "token_id": t,
                                            "text": piece})
                        piece, index = "", index + 1
                    if ev.finish_reason == "error":
                        raise APIError(ev.error or "generation failed", status=ev.error_status or 503)
                    if ev.finish_reason:
                        await ws.send_json({"type": "done", "finish_reason": _finish(ev),
                                            "usage": _usage([p], ev)})
        except APIError as e:
            metrics.REQUESTS.labels("/v1/stream", str(e.status)).inc()
            await ws.send_json({"type": "error", "message": str(e)})
        except WebSocketDisconnect:
            metrics.REQUESTS.labels("/v1/stream", "499").inc()  # client closed early, as nginx logs it
            return
        else:
            metrics.REQUESTS.labels("/v1/stream", "200").inc()
        await ws.close()

    return app
