"""OpenTelemetry traces through a real fleet (`shoal up --otlp-traces-endpoint`): the gateway's
span of each request continues the client's W3C trace context, and the scheduler's span of the
same request is its child, across processes; both reach an OTLP/HTTP collector (a small one in
this test, decoding the protobuf the exporters send)."""

from __future__ import annotations

import http.server
import os
import signal
import subprocess
import threading
import time

import httpx
import pytest

from shoal.fleet import free_port, shoal_command

pytest.importorskip("opentelemetry.sdk.trace", reason="shoal[tracing] is not installed")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http")

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class Collector(http.server.ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver: every span posted to /v1/traces, flattened to a dict."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
                    ExportTraceServiceRequest,
                )

                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                collector.spans += [span for rs in request.resource_spans
                                    for span in _flatten(rs)]
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def wait_for(self, predicate, timeout_s: float = 30.0) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = [s for s in self.spans if predicate(s)]
            if found:
                return found
            time.sleep(0.1)
        raise AssertionError(f"no such span among {[s['name'] for s in self.spans]}")


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


def _flatten(resource_spans) -> list[dict]:
    service = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
    return [{"service": service.get("service.name"), "name": s.name,
             "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
             "parent_id": s.parent_span_id.hex(),
             "attributes": {a.key: _value(a.value) for a in s.attributes},
             "events": [e.name for e in s.events]}
            for scope in resource_spans.scope_spans for s in scope.spans]


@pytest.fixture(scope="module")
def traced_fleet():
    collector = Collector()
    port = free_port()
    env = {**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "100"}  # export every 0.1 s, not 5 s
    up = subprocess.Popen([*shoal_command(), "up", "--port", str(port), "--kv-cache-bytes",
                           str(128 << 20), "--threads", "1", "--metrics-port-base", "0",
                           "--otlp-traces-endpoint",
                           f"http://127.0.0.1:{collector.server_port}/v1/traces"],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line, deadline = "", time.monotonic() + 180
        while "ready at" not in line and time.monotonic() < deadline:
            line = up.stdout.readline()
            assert line or up.poll() is None, "shoal up exited early"
        yield f"http://127.0.0.1:{port}", collector
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(60)
        collector.shutdown()


def test_a_requests_spans_continue_the_clients_trace_across_the_fleet(traced_fleet):
    url, collector = traced_fleet
    r = httpx.post(url + "/v1/completions", timeout=60,
                   headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
                   json={"prompt": "The sea is", "max_tokens": 5, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200
    body = r.json()
    (gateway,) = collector.wait_for(lambda s: s["name"] == "llm_request"
                                    and s["attributes"]["gen_ai.request.id"] == body["id"])
    assert gateway["service"] == "shoal-gateway"
    assert (gateway["trace_id"], gateway["parent_id"]) == (TRACE_ID, PARENT_ID)
    a = gateway["attributes"]
    assert a["gen_ai.usage.prompt_tokens"] == body["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.completion_tokens"] == 5 and a["gen_ai.request.max_tokens"] == 5
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]

    (scheduled,) = collector.wait_for(lambda s: s["name"] == "llm_request.schedule"
                                      and s["attributes"]["gen_ai.request.id"] == body["id"])
    assert scheduled["service"] == "shoal-scheduler"
    assert (scheduled["trace_id"], scheduled["parent_id"]) == (TRACE_ID, gateway["span_id"])
    b = scheduled["attributes"]
    assert b["shoal.worker.id"] == "worker-0" and b["gen_ai.usage.completion_tokens"] == 5
    assert b["gen_ai.latency.time_in_queue"] >= 0 and b["shoal.request.migrations"] == 0
    assert scheduled["events"] == ["admitted", "first_token"]


def test_a_request_the_client_leaves_ends_cancelled_in_both_spans(traced_fleet):
    """Without a traceparent the gateway's span starts a trace; a client that leaves mid-stream
    ends both spans as cancelled (the scheduler records a cancelled request's span too)."""
    url, collector = traced_fleet
    with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
            "prompt": "Count to a thousand:", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
    request_id = httpx.Response(200, content=first[6:]).json()["id"]
    (gateway,) = collector.wait_for(lambda s: s["name"] == "llm_request"
                                    and s["attributes"]["gen_ai.request.id"] == request_id)
    assert gateway["parent_id"] == "" and gateway["trace_id"] != TRACE_ID
    assert gateway["attributes"]["gen_ai.response.finish_reasons"] == ["cancelled"]
    (scheduled,) = collector.wait_for(lambda s: s["name"] == "llm_request.schedule"
                                      and s["attributes"]["gen_ai.request.id"] == request_id)
    assert scheduled["parent_id"] == gateway["span_id"]
    assert scheduled["attributes"]["gen_ai.response.finish_reasons"] == ["cancelled"]
    assert scheduled["attributes"]["gen_ai.usage.completion_tokens"] < 400


def test_a_request_the_scheduler_fails_ends_in_error_in_both_spans(traced_fleet):
    """A request larger than any worker's K/V cache (the up fleet's worker holds 5,824 tokens)
    is failed by the scheduler itself: its span records it as well as the gateway's."""
    url, collector = traced_fleet
    r = httpx.post(url + "/v1/completions", timeout=60,
                   json={"prompt": "Hello", "max_tokens": 7000, "temperature": 0})
    assert r.status_code == 400 and "K/V blocks" in r.json()["error"]["message"]
    (gateway,) = collector.wait_for(lambda s: s["name"] == "llm_request"
                                    and s["attributes"]["gen_ai.request.max_tokens"] == 7000)
    assert gateway["attributes"]["gen_ai.response.finish_reasons"] == ["error"]
    request_id = gateway["attributes"]["gen_ai.request.id"]
    (scheduled,) = collector.wait_for(lambda s: s["name"] == "llm_request.schedule"
                                      and s["attributes"]["gen_ai.request.id"] == request_id)
    assert scheduled["parent_id"] == gateway["span_id"]
    assert scheduled["attributes"]["gen_ai.response.finish_reasons"] == ["error"]
    assert scheduled["events"] == []  # never admitted
