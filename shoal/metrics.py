"""Helpers every part uses to export Prometheus metrics (prometheus-client).

Metric definitions live with the part that owns them (gateway/metrics.py, scheduler/metrics.py,
worker/metrics.py); this module holds the shared histogram buckets and the exporter start-up.
Conventions: names prefixed `shoal_`, base units (seconds, tokens, blocks), counters end in
`_total`, labels of low cardinality only (never a request id).
"""

from __future__ import annotations

# Latency buckets in seconds, from a fast decode step to a long queued generation.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
SCHEDULING_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def serve_metrics(port: int) -> None:
    """Export the default registry on `http://0.0.0.0:port/metrics`; port 0 turns it off."""
    if port:
        from prometheus_client import start_http_server

        start_http_server(port)
