"""The worker's Prometheus metrics."""

from prometheus_client import Counter, Gauge, Histogram

from shoal.metrics import STEP_BUCKETS

ENGINE_STEP_SECONDS = Histogram(
    "shoal_engine_step_seconds", "Wall time of one engine iteration, by phase "
    "(prefill: only prefill chunks; decode: only decodes; mixed: both)", ["phase"],
    buckets=STEP_BUCKETS)
ENGINE_TOKENS = Counter("shoal_engine_tokens_total", "Tokens computed by the engine, by phase",
                        ["phase"])
KV_CACHE_USAGE = Gauge("shoal_kv_cache_usage_ratio", "Share of K/V-cache blocks in use (0-1)")
PREFIX_CACHE_QUERIES = Counter("shoal_prefix_cache_queries",
                               "Tokens of requests looked up in the prefix cache when they start")
PREFIX_CACHE_HITS = Counter("shoal_prefix_cache_hits",
                            "Tokens found in the prefix cache (their K/V not computed again)")
SPEC_DRAFT_TOKENS = Counter("shoal_spec_decode_num_draft_tokens",
                            "Speculative draft tokens checked by the model")
SPEC_ACCEPTED_TOKENS = Counter("shoal_spec_decode_num_accepted_tokens",
                               "Speculative draft tokens the model kept (each one a pass saved)")
STRUCTURED_OUTPUT_ROWS = Counter("shoal_structured_output_rows",
                                 "Sampling rows masked by their request's structured output")
STRUCTURED_OUTPUT_MASK_SECONDS = Counter(
    "shoal_structured_output_mask_seconds",
    "Seconds iterations spent waiting for structured outputs' masks (built while the forward "
    "pass runs) and applying them")
MODEL_LOAD_SECONDS = Gauge("shoal_model_load_seconds", "Time to load the model, in seconds")
FAILED_ITERATIONS = Counter("shoal_engine_failed_iterations",
                            "Iterations whose engine step raised (their requests then recomputed "
                            "in halves to find the one that broke it)")
FAILED_REQUESTS = Counter("shoal_engine_failed_requests",
                          "Requests that broke the engine, found alone and failed (500)")


def observe_iteration(num_prefill_tokens: int, num_decode_tokens: int, step_seconds: float,
                      free_blocks: int, total_blocks: int) -> None:
    """Record one iteration's figures."""
    if num_prefill_tokens and num_decode_tokens:
        phase = "mixed"
    elif num_prefill_tokens:
        phase = "prefill"
    elif num_decode_tokens:
        phase = "decode"
    else:
        return
    ENGINE_STEP_SECONDS.labels(phase).observe(step_seconds)
    if num_prefill_tokens:
        ENGINE_TOKENS.labels("prefill").inc(num_prefill_tokens)
    if num_decode_tokens:
        ENGINE_TOKENS.labels("decode").inc(num_decode_tokens)
    KV_CACHE_USAGE.set(1.0 - free_blocks / total_blocks)


class EngineTotals:
    """Carries the engine's running totals (attributes that only grow) into Prometheus counters:
    prefix-cache queries and hits, speculative drafts and those kept (tokens), rows masked by
    structured outputs and the seconds their masks cost."""

    COUNTERS = {"prefix_cache_queries": PREFIX_CACHE_QUERIES, "prefix_cache_hits": PREFIX_CACHE_HITS,
                "spec_draft_tokens": SPEC_DRAFT_TOKENS, "spec_accepted_tokens": SPEC_ACCEPTED_TOKENS,
                "structured_output_rows": STRUCTURED_OUTPUT_ROWS,
                "structured_output_mask_seconds": STRUCTURED_OUTPUT_MASK_SECONDS}

    def __init__(self) -> None:
        self.seen = dict.fromkeys(self.COUNTERS, 0)

    def observe(self, engine) -> None:
        for name, counter in self.COUNTERS.items():
            value = getattr(engine, name)
            counter.inc(value - self.seen[name])
            self.seen[name] = value
