"""The scheduler's Prometheus metrics."""

from prometheus_client import Counter, Gauge, Histogram

from shoal.metrics import BATCH_SIZE_BUCKETS, SCHEDULING_BUCKETS, TOKEN_BUCKETS, TTFT_BUCKETS

REQUESTS_WAITING = Gauge("shoal_requests_waiting", "Requests in the pool not yet on a worker",
                         ["model_name"])
REQUESTS_RUNNING = Gauge("shoal_requests_running", "Requests placed on a worker")
QUEUE_TIME = Histogram("shoal_request_queue_time_seconds",
                       "Time from arrival at the gateway to admission on a worker",
                       buckets=TTFT_BUCKETS)
BATCH_SIZE = Histogram("shoal_iteration_batch_size", "Requests in one worker iteration",
                       buckets=BATCH_SIZE_BUCKETS)
ITERATION_TOKENS = Histogram("shoal_iteration_tokens", "Tokens (prefill + decode) in one iteration",
                             buckets=TOKEN_BUCKETS)
SCHEDULING_SECONDS = Histogram("shoal_scheduling_seconds", "Time to make one iteration plan",
                               buckets=SCHEDULING_BUCKETS)
WORKERS_ALIVE = Gauge("shoal_workers_alive", "Workers with a live heartbeat")
KV_BLOCKS_FREE = Gauge("shoal_kv_blocks_free", "Free K/V blocks a worker advertises", ["worker"])
KV_BLOCKS_TOTAL = Gauge("shoal_kv_blocks_total", "K/V blocks of a worker", ["worker"])
PREEMPTIONS = Counter("shoal_preemptions_total",
                      "Requests handed back by a worker (out of K/V, or draining) to recompute")
REQUESTS_FINISHED = Counter("shoal_requests_finished_total", "Requests finished, by reason",
                            ["finish_reason"])
ORPHANED_REQUESTS = Counter("shoal_requests_orphaned_total",
                            "Requests cancelled because their gateway was gone (no listener on "
                            "its token channel for --orphan-timeout seconds); counted in "
                            "shoal_requests_finished_total as cancelled too")
