"""OpenTelemetry traces of requests through the fleet, as vLLM's `--otlp-traces-endpoint`.

The gateway starts one span per request it puts into the fleet (`llm_request`), the child of
the client's W3C trace context when its HTTP request carries one (`traceparent`,
`tracestate`). The request carries that span's context to the scheduler
(`RequestSubmission.trace_context`), which records the request's life in the fleet as a child
span (`llm_request.schedule`: its queue time, the worker that ran it, its first token, its
migrations) when the request ends: finished, cancelled, or failed by the scheduler itself. Both export in batches over OTLP (HTTP/protobuf unless
`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` is `grpc`) to the collector at the endpoint given; the
other OTEL_* variables of the OpenTelemetry SDK apply (the batch delay, the exporter's headers).

Attribute names follow OpenTelemetry's generative-AI conventions where they have one and vLLM's
names where they do not, so that dashboards built for vLLM's traces read shoal's.

The OpenTelemetry SDK is optional (`pip install 'shoal[tracing]'`); without
`--otlp-traces-endpoint` nothing here is imported and no request pays for tracing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context


class SpanAttributes:
    """The attribute names shoal's spans set."""

    REQUEST_ID = "gen_ai.request.id"
    REQUEST_MODEL = "gen_ai.request.model"
    RESPONSE_MODEL = "gen_ai.response.model"
    REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    REQUEST_TOP_P = "gen_ai.request.top_p"
    USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    USAGE_CACHED_TOKENS = "gen_ai.usage.cached_tokens"
    FINISH_REASONS = "gen_ai.response.finish_reasons"
    TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"  # seconds
    TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"  # seconds
    E2E = "gen_ai.latency.e2e"  # seconds
    # shoal's own: where the fleet ran the request.
    WORKER = "shoal.worker.id"
    PRIORITY = "shoal.request.priority"
    MIGRATIONS = "shoal.request.migrations"


class TracingUnavailable(RuntimeError):
    """Tracing was asked for, but the OpenTelemetry SDK or its OTLP exporter is not installed."""


def span_exporter_class() -> type:
    """The OTLP span exporter of the protocol asked for (`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`:
    http/protobuf, the default, or grpc).

    Raises:
        TracingUnavailable: the SDK or that exporter is not installed.
    """
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    try:
        import opentelemetry.sdk.trace  # noqa: F401

        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as e:
        raise TracingUnavailable(
            f"--otlp-traces-endpoint needs the OpenTelemetry SDK and its OTLP exporter "
            f"({e.name} is missing): pip install 'shoal[tracing]'") from e
    return OTLPSpanExporter


def init_tracer(service_name: str, endpoint: str) -> Any:
    """A tracer whose spans go to the OTLP collector at `endpoint`, in batches, from a
    service named `service_name` (`shoal-gateway`, `shoal-scheduler`). The spans still
    batched are exported when the process exits (the SDK's provider shuts down at exit).

    Raises:
        TracingUnavailable: the SDK or the exporter is not installed.
    """
    exporter = span_exporter_class()
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(exporter(endpoint=endpoint)))
    return provider.get_tracer("shoal")


def context_of(carrier: Mapping[str, str] | None) -> Any:
    """The trace context a carrier holds (HTTP headers, a request's `trace_context`), for a
    span's parent; an empty context when it holds none."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(dict(carrier or {}))


def carrier_of(span: Any) -> dict[str, str]:
    """The W3C headers of a span's context (`traceparent`, `tracestate`), for a process that
    continues its trace."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def start_request_span(tracer: Any, request_id: str, model: str, params: Any,
                       prompt_tokens: int, priority: int) -> Any:
    """The gateway's span of one request in the fleet (`llm_request`), a child of the current
    trace context (the client's, when it sent one); `params` are its `SamplingParams`."""
    from opentelemetry.trace import SpanKind

    a = SpanAttributes
    return tracer.start_span("llm_request", kind=SpanKind.SERVER, attributes={
        a.REQUEST_ID: request_id, a.REQUEST_MODEL: model, a.RESPONSE_MODEL: model,
        a.REQUEST_MAX_TOKENS: params.max_tokens, a.REQUEST_TEMPERATURE: params.temperature,
        a.REQUEST_TOP_P: params.top_p, a.USAGE_PROMPT_TOKENS: prompt_tokens,
        a.PRIORITY: priority})


def end_request_span(span: Any, finish_reason: str | None, completion_tokens: int,
                     cached_tokens: int, ttft_s: float | None, e2e_s: float,
                     error: str | None = None) -> None:
    """End the gateway's span of a request: how it finished (None: the client left first),
    its tokens, and its latencies in seconds (`ttft_s` None: no token came)."""
    from opentelemetry.trace import Status, StatusCode

    a = SpanAttributes
    span.set_attributes({a.FINISH_REASONS: [finish_reason or "cancelled"],
                         a.USAGE_COMPLETION_TOKENS: completion_tokens,
                         a.USAGE_CACHED_TOKENS: cached_tokens, a.E2E: e2e_s})
    if ttft_s is not None:
        span.set_attribute(a.TIME_TO_FIRST_TOKEN, ttft_s)
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


def record_schedule_span(tracer: Any, sub: Any, worker_id: str | None, finish_reason: str,
                         completion_tokens: int, cached_tokens: int, migrations: int,
                         admitted_at: float | None, first_token_at: float | None,
                         finished_at: float) -> None:
    """The scheduler's span of a finished request (`llm_request.schedule`), recorded whole at
    its end: from its arrival (`sub`, its `RequestSubmission`, whose `trace_context` is the
    parent) to `finished_at`, with events at its admission and first token (Unix times, in
    seconds) and the queue time."""
    a = SpanAttributes

    def ns(t: float) -> int:
        return int(t * 1e9)

    span = tracer.start_span("llm_request.schedule", context=context_of(sub.trace_context),
                             start_time=ns(sub.arrival_time), attributes={
                                 a.REQUEST_ID: sub.request_id, a.REQUEST_MODEL: sub.model,
                                 a.PRIORITY: sub.priority,
                                 a.USAGE_PROMPT_TOKENS: len(sub.prompt_token_ids),
                                 a.USAGE_COMPLETION_TOKENS: completion_tokens,
                                 a.USAGE_CACHED_TOKENS: cached_tokens,
                                 a.FINISH_REASONS: [finish_reason], a.MIGRATIONS: migrations,
                                 a.E2E: finished_at - sub.arrival_time})
    if worker_id is not None:
        span.set_attribute(a.WORKER, worker_id)
    if admitted_at is not None:
        span.set_attribute(a.TIME_IN_QUEUE, admitted_at - sub.arrival_time)
        span.add_event("admitted", timestamp=ns(admitted_at))
    if first_token_at is not None:
        span.set_attribute(a.TIME_TO_FIRST_TOKEN, first_token_at - sub.arrival_time)
        span.add_event("first_token", timestamp=ns(first_token_at))
    span.end(end_time=ns(finished_at))
