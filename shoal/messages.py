"""Every message that crosses a process boundary, defined once.

Messages are frozen dataclasses encoded with msgpack as a map carrying the protocol version `v`
and the message type `t`. `encode` / `decode` are the only serialisation code in shoal; a reader
that gets another version or an unknown type raises `ProtocolError` rather than guessing. A scalar
field equal to its default is left out of the map and the reader's dataclass fills it back in.

The engine's own iteration API speaks these types too (`IterationPlan` in, `IterationResult`
out), so what the scheduler sends is exactly what the engine runs.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from shoal.sampling_params import SamplingParams

PROTOCOL_VERSION = 1


class ProtocolError(ValueError):
    """A message of another protocol version, of an unknown type, or malformed."""


_REGISTRY: dict[str, type[Message]] = {}


@dataclass(frozen=True)
class Message:
    """Base of all wire messages; subclasses set `TYPE`."""

    TYPE: ClassVar[str] = ""

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if cls.TYPE:
            _REGISTRY[cls.TYPE] = cls

    def to_dict(self) -> dict[str, Any]:
        """Every field, nested messages as dicts."""
        return {name: _to_plain(getattr(self, name)) for name in _field_order(type(self))}

    def wire_dict(self) -> dict[str, Any]:
        """The map `encode` sends: `to_dict` without the scalar fields that equal their default
        (a token event's finish reason, error and usage until its last one). Readers of every
        build fill those in from the same defaults; list fields are always sent, since readers
        index some of them directly. A decode iteration of 64 requests: the result 5,181 ->
        3,149 bytes, the token events 8,288 -> 3,808, and packing plus unpacking both across the
        three processes that handle them 551 -> 349 us."""
        out = {}
        for name, default in _wire_fields(type(self)):
            v = getattr(self, name)
            if default is _ALWAYS or v != default:
                out[name] = _to_plain(v)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Message:
        if d.keys() <= _field_names(cls):  # the usual case: nothing to drop
            return cls(**d)
        return cls(**cls.known_fields(d))

    @classmethod
    def known_fields(cls, d: dict[str, Any]) -> dict[str, Any]:
        """`d` without the fields this build does not know. A newer build may add a field with a
        default without bumping PROTOCOL_VERSION; older readers ignore it, so a fleet can be
        upgraded one process at a time."""
        names = _field_names(cls)
        return {k: v for k, v in d.items() if k in names}


@functools.cache
def _field_order(cls: type) -> tuple[str, ...]:
    """A message class's field names in order (computed once: every encoded message asks)."""
    return tuple(f.name for f in dataclasses.fields(cls))


_ALWAYS = object()  # a field that goes on the wire whatever its value


@functools.cache
def _wire_fields(cls: type) -> tuple[tuple[str, Any], ...]:
    """(name, default) of a message class's fields, the default `_ALWAYS` where the field is
    always sent: no default, a default factory (lists), or a default that is not a scalar."""
    out = []
    for f in dataclasses.fields(cls):
        scalar = f.default is None or isinstance(f.default, (bool, int, float, str))
        out.append((f.name, f.default if f.default is not dataclasses.MISSING and scalar
                    else _ALWAYS))
    return tuple(out)


@functools.cache
def _field_names(cls: type) -> frozenset[str]:
    """A message class's field names (computed once: every decoded message asks)."""
    return frozenset(_field_order(cls))


def _to_plain(v: Any) -> Any:
    if isinstance(v, Message):
        return v.wire_dict()
    if isinstance(v, SamplingParams):
        return v.to_dict()
    if isinstance(v, (list, tuple)):
        # Lists on the wire hold one kind of element. Token ids, logprobs and ids go to msgpack
        # as they are: converting them one by one took about 15% of the scheduler's CPU (a plan
        # admitting prompts carries thousands of token ids).
        if not v or not isinstance(v[0], (Message, SamplingParams, list, tuple)):
            return v
        return [_to_plain(x) for x in v]
    return v


def encode(msg: Message) -> bytes:
    """msgpack bytes of `msg`, tagged with its type and the protocol version."""
    return msgpack.packb({"v": PROTOCOL_VERSION, "t": msg.TYPE, "m": msg.wire_dict()})


def decode(data: bytes) -> Message:
    """Inverse of `encode`.

    Raises:
        ProtocolError: not msgpack, another protocol version, an unknown type or bad fields.
    """
    try:
        env = msgpack.unpackb(data)
        version, kind, body = env["v"], env["t"], env["m"]
    except Exception as e:
        raise ProtocolError(f"malformed message: {e}") from e
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version}, this build speaks {PROTOCOL_VERSION}")
    cls = _REGISTRY.get(kind)
    if cls is None:
        raise ProtocolError(f"unknown message type {kind!r}")
    try:
        return cls.from_dict(body)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise ProtocolError(f"bad {kind} message: {e!r}") from e


@dataclass(frozen=True)
class NewRequest(Message):
    """A request entering a worker's engine.

    Attributes:
        request_id: unique id.
        prompt_token_ids: the prompt.
        params: sampling parameters.
        output_token_ids: tokens already generated elsewhere (a request recomputed after
            preemption or migration); they are prefilled with the prompt and count toward
            `max_tokens`.
    """

    TYPE: ClassVar[str] = "new_request"
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NewRequest:
        return cls(**{**cls.known_fields(d), "params": SamplingParams.from_dict(d["params"])})


@dataclass(frozen=True)
class IterationPlan(Message):
    """What one worker runs in its next iteration.

    Attributes:
        iteration: the scheduler's counter for this worker, echoed in the result.
        admit: requests joining now.
        run: ids of running requests that take part; None means every running request.
        release: ids to drop before running (finished elsewhere, cancelled, preempted); their
            K/V blocks are freed.
        reset: drop every running request first (a new scheduler took over and re-admits what
            is still unfinished).
    """

    TYPE: ClassVar[str] = "iteration_plan"
    iteration: int = 0
    admit: list[NewRequest] = field(default_factory=list)
    run: list[str] | None = None
    release: list[str] = field(default_factory=list)
    reset: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> IterationPlan:
        return cls(**{**cls.known_fields(d), "admit": [NewRequest.from_dict(a) for a in d["admit"]]})


@dataclass(frozen=True)
class TokenOutput(Message):
    """One request's outcome in one iteration.

    Attributes:
        request_id: the request.
        token_id: the sampled token, or None when the request did not sample this iteration (a
            prefill chunk that did not reach the end of the prompt, or an error).
        index: position of `token_id` in the request's output (0 = first generated token).
        logprob: log-probability of the token when the request asked for it.
        finish_reason: "stop" (EOS or a stop token), "length" (max_tokens or the context window),
            "error", or None while the request goes on.
        error: what went wrong when `finish_reason` is "error".
        error_status: the HTTP status that error maps to: None for 400 (the engine cannot run
            the request, see `Engine.add_request`), 500 when the engine failed while running it.
        num_cached_tokens: on a request's first token (index 0), the tokens of its prompt that
            it found in the worker's prefix cache instead of computing them.
        top_logprobs: when the request asked for `top_logprobs` k, the k most likely tokens at
            this step as `[token id, logprob]` pairs, most likely first; else None (left off the
            wire).
        prompt_logprobs: for a request that asked for `prompt_logprobs`, an output with no
            token that carries the logprobs of prompt tokens `prompt_position`,
            `prompt_position + 1`, ... (each given the tokens before it) computed this
            iteration; else None.
        prompt_top_logprobs: with `prompt_logprobs` k > 0, each of those positions' k most
            likely tokens as `[token id, logprob]` pairs; else None.
        prompt_position: the prompt position of the first of `prompt_logprobs` (>= 1).
        prompt_ranks: with `prompt_logprobs`, each of those prompt tokens' rank at its position
            (1 for the most likely token; one more for each token more likely than it).
    """

    TYPE: ClassVar[str] = "token_output"
    request_id: str
    token_id: int | None
    index: int
    logprob: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    top_logprobs: list[list] | None = None
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[list]] | None = None
    prompt_position: int = 0
    prompt_ranks: list[int] | None = None
    error_status: int | None = None


@dataclass(frozen=True)
class IterationResult(Message):
    """What a worker reports after one iteration.

    Attributes:
        worker_id: the worker.
        iteration: the plan's counter.
        outputs: one entry per request that sampled or finished.
        num_free_blocks: free K/V blocks after the iteration.
        num_prefill_tokens, num_decode_tokens: tokens computed this iteration.
        step_seconds: wall time of the iteration in seconds.
        num_requests: requests that ran in the iteration (the batch size).
        num_pending_prefill_tokens: prompt tokens of running requests still to be computed after
            the iteration (chunked prefill): the scheduler estimates the next iteration's length
            from them.
    """

    TYPE: ClassVar[str] = "iteration_result"
    worker_id: str
    iteration: int
    outputs: list[TokenOutput]
    num_free_blocks: int
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    step_seconds: float = 0.0
    num_requests: int = 0
    num_pending_prefill_tokens: int = 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> IterationResult:
        return cls(**{**cls.known_fields(d), "outputs": [TokenOutput.from_dict(o) for o in d["outputs"]]})


@dataclass(frozen=True)
class RequestSubmission(Message):
    """A client's request entering the fleet (gateway → scheduler, on the requests stream).

    Attributes:
        request_id: unique id.
        model: the model id the client asked for.
        prompt_token_ids: the tokenized prompt.
        params: sampling parameters.
        arrival_time: Unix time in seconds when the gateway accepted it (FCFS order).
        reply_to: pub/sub channel of the gateway waiting for its tokens.
        priority: lower is served first (as in vLLM); interactive requests 0, batch jobs 1.
            The scheduler ages waiting requests so none waits forever (scheduler/core.py).
        trace_context: the W3C headers (`traceparent`, `tracestate`) of the gateway's span of
            this request, when the gateway traces (shoal/tracing.py); else None.
    """

    TYPE: ClassVar[str] = "request_submission"
    request_id: str
    model: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    reply_to: str
    priority: int = 0
    trace_context: dict[str, str] | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestSubmission:
        return cls(**{**cls.known_fields(d), "params": SamplingParams.from_dict(d["params"])})


@dataclass(frozen=True)
class WorkerInfo(Message):
    """A worker's registration and heartbeat.

    Attributes:
        worker_id: unique id.
        model: model id served.
        num_total_blocks, num_free_blocks: K/V blocks.
        block_size: tokens per block.
        max_num_seqs: most requests per iteration.
        max_model_len: context window in tokens.
        num_running: requests in its engine.
        draining: it takes no new requests (SIGTERM received).
        incarnation: random per process start; a worker restarted under the same id has a new
            one, so the scheduler knows the old process (and what it ran) is gone.
        heartbeat_at: when the worker wrote this, Unix seconds (0 where unknown).
        max_num_batched_tokens: most tokens in one of its iterations (0 where unknown).
        prefix_caching: it caches prompt prefixes (the scheduler then places requests where
            their prefix is likely cached).
        loras: the LoRA adapters it serves, name -> directory (`--lora-modules` and those
            loaded at run time); the scheduler places a request naming one only here.
        lora_errors: adapters of the fleet's run-time list (`Keys.loras`) it could not load,
            name -> [directory, why] (a gateway loading one reports it).
    """

    TYPE: ClassVar[str] = "worker_info"
    worker_id: str
    model: str
    num_total_blocks: int
    num_free_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    num_running: int = 0
    draining: bool = False
    incarnation: str = ""
    heartbeat_at: float = 0.0
    max_num_batched_tokens: int = 0
    prefix_caching: bool = False
    loras: dict[str, str] = field(default_factory=dict)
    lora_errors: dict[str, list[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class TokenEvent(Message):
    """Tokens of one request for its gateway (scheduler → gateway, pub/sub).

    Attributes:
        request_id: the request.
        index: position of the first of `token_ids` in the output; receivers drop duplicates.
        token_ids: new tokens (may be empty on a final or error event).
        logprobs: their logprobs when asked for.
        finish_reason: "stop", "length", "error", "cancelled" or None.
        error: the reason when `finish_reason` is "error".
        prompt_tokens, completion_tokens: usage, set on the final event.
        error_status: the HTTP status the error maps to: 400 when the request itself cannot be
            served (too long, too large for any worker), 503 when the fleet failed it.
        cached_tokens: prompt tokens found in the prefix cache (OpenAI's
            `usage.prompt_tokens_details.cached_tokens`), known from the first token on.
        top_logprobs: per token of `token_ids`, its step's most likely tokens as `[token id,
            logprob]` pairs (`TokenOutput.top_logprobs`), when the request asked for them; else
            None.
        prompt_logprobs, prompt_top_logprobs, prompt_position, prompt_ranks: prompt-token
            logprobs, as in `TokenOutput` (an event with no tokens); a recomputed prompt sends
            them again.
    """

    TYPE: ClassVar[str] = "token_event"
    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[float | None] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error_status: int | None = None
    cached_tokens: int = 0
    top_logprobs: list[list[list]] | None = None
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[list]] | None = None
    prompt_position: int = 0
    prompt_ranks: list[int] | None = None


@dataclass(frozen=True)
class TokenEvents(Message):
    """Every `TokenEvent` of one iteration for one gateway, in one pub/sub message (scheduler →
    gateway): a message per token cost the scheduler, Redis and the gateway a publish, a
    delivery and a parse each, CPU taken from the worker on a shared machine."""

    TYPE: ClassVar[str] = "token_events"
    events: list[TokenEvent]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TokenEvents:
        return cls(events=[TokenEvent.from_dict(e) for e in d["events"]])


@dataclass(frozen=True)
class Cancel(Message):
    """A client went away or asked to stop (gateway → scheduler)."""

    TYPE: ClassVar[str] = "cancel"
    request_id: str
