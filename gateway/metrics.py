"""The gateway's Prometheus metrics."""

from prometheus_client import Counter, Gauge, Histogram

from shoal.metrics import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS

REQUESTS = Counter("shoal_requests_total", "HTTP and WebSocket requests, by endpoint and status",
                   ["endpoint", "status"])
# Per model (`model_name`, vLLM's label: the name the workers advertise), for fleets serving
# several.
TTFT = Histogram("shoal_time_to_first_token_seconds",
                 "Time from accepting a request to its first token", ["model_name"],
                 buckets=TTFT_BUCKETS)
ITL = Histogram("shoal_inter_token_latency_seconds", "Time between consecutive tokens of a request",
                ["model_name"], buckets=ITL_BUCKETS)
E2E = Histogram("shoal_e2e_request_latency_seconds", "Time from accepting a request to its end",
                ["model_name"], buckets=E2E_BUCKETS)
PROMPT_TOKENS = Counter("shoal_prompt_tokens_total", "Prompt tokens of accepted requests",
                        ["model_name"])
GENERATION_TOKENS = Counter("shoal_generation_tokens_total", "Tokens streamed back to clients",
                            ["model_name"])
ACTIVE_STREAMS = Gauge("shoal_active_streams", "Requests the gateway is waiting on")
