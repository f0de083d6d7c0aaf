"""`shoal generate` as a user runs it: real process, real model."""

from __future__ import annotations

import json
import subprocess

import pytest

from shoal.fleet import shoal_command


def _shoal(*args, timeout=300):
    return subprocess.run([*shoal_command(), *args], capture_output=True, text=True,
                          timeout=timeout)


def test_generate_chat_streams_the_greedy_answer():
    r = _shoal("generate", "--chat", "--max-tokens", "20", "What is the capital of France?")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_generate_float32_matches_in_process_engine(fp32_model, tokenizer):
    from shoal.messages import NewRequest
    from shoal.sampling_params import SamplingParams
    from tests.conftest import make_engine
    from worker.offline import generate

    prompt = "The three primary colours are"
    r = _shoal("generate", "--dtype", "float32", "--max-tokens", "12", prompt)
    assert r.returncode == 0, r.stderr
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    out = generate(make_engine(fp32_model), [NewRequest("x", ids, SamplingParams(max_tokens=12, temperature=0))])
    assert r.stdout.rstrip("\n") == tokenizer.decode(out["x"].token_ids, skip_special_tokens=True)


def test_bad_arguments_fail_clearly(tmp_path):
    cases = [
        (["generate", "--max-tokens", "0", "hi"], "positive integer"),
        (["generate", "--temperature", "-1", "hi"], "temperature"),
        (["generate", "--model", str(tmp_path / "missing.gguf"), "hi"], "does not exist"),
        (["generate", ""], "empty"),
        (["generate", "--top-p", "2", "hi"], "top_p"),
        (["generate", "--kv-cache-memory-fraction", "1.5", "hi"], "kv_cache_memory_fraction"),
        (["generate", "--kv-cache-bytes", "1000", "hi"], "K/V"),
        (["generate", "--device", "tpu", "hi"], "device"),
        (["generate", "--tensor-parallel-size", "2", "hi"], "must divide"),
        (["generate", "--attention-backend", "triton", "--block-size", "8", "hi"], "power of two"),
        (["bench", "engine", "--quick", "--temperature", "-1"], "temperature"),
        (["bench", "serve", "--top-p", "0"], "top_p"),
        (["generate", "--speculative-config", "{", "hi"], "not JSON"),
        (["up", "--speculative-config", '{"method": "eagle"}'], "ngram"),
        (["bench", "fleet", "--rounds", "0"], "positive integer"),
        (["bench", "fleet", "--model", str(tmp_path / "missing.gguf")], "does not exist"),
    ]
    # All at once: each is a process that imports torch, most of its time spent starting.
    procs = [subprocess.Popen([*shoal_command(), *args], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for args, _ in cases]
    for (args, needle), proc in zip(cases, procs):
        _, err = proc.communicate(timeout=300)
        assert proc.returncode != 0
        assert needle in err and "Traceback" not in err, (args, err)


def test_bench_engine_quick_writes_its_json(tmp_path):
    out = tmp_path / "engine.json"
    r = _shoal("bench", "engine", "--quick", "--output", str(out), timeout=600)
    assert r.returncode == 0, r.stderr
    import json

    figures = json.loads(out.read_text())
    from worker.config import resolve_dtype

    assert figures["dtype"] == str(resolve_dtype("auto")).removeprefix("torch.")
    assert figures["shoal"]["generated_tokens"] > 0
    runs = figures["shoal_runs"]  # the same requests three times; the median run is reported
    assert len(runs) == 3 and {r["generated_tokens"] for r in runs} == {figures["shoal"]["generated_tokens"]}
    # Each run starts from an empty prefix cache: the repeats compute their prompts again.
    assert [r["prefix_cache_hit_tokens"] for r in runs] == [0, 0, 0]
    speeds = sorted(r["generated_tokens_per_s"] for r in runs)
    assert figures["shoal"]["generated_tokens_per_s"] == speeds[1]
    # The single streams run as many times, their medians reported.
    singles = sorted(figures["single_stream_runs"])
    assert len(singles) == 3 and figures["single_stream_decode_tokens_per_s"] == singles[1]
    chats = sorted(figures["chat_single_stream_runs"])
    assert len(chats) == 3 and figures["chat_single_stream"]["generated_tokens_per_s"] == chats[1]
    assert figures["transformers_static_batch8"]["generated_tokens"] == figures["shoal"]["generated_tokens"]
    assert set(figures["decode_tokens_per_s"]) == {"1", "8"}
    assert "generated tokens/s" in r.stdout
    levels = figures["q4_levels"]  # SmolLM2 ships all 120 projections as Q4_1
    assert levels["of"] == 120 and levels["projections"] in (0, 120)
    if figures["cpu_kernels"] and figures["avx512_bf16"]:  # q4_linear, or q4_amx_linear
        assert levels["projections"] == 120 and levels["max_rows"] >= 8
    # Where the C++ kernels serve (AMX tiles, dp_linear's pairs in bfloat16, f32_linear's lanes
    # in float32), iterations of up to STACK_MAX_ROWS run all layers in one call.
    from worker.model import STACK_MAX_ROWS

    assert figures["decode_stack_max_rows"] == (STACK_MAX_ROWS if figures["cpu_kernels"] else 0)
    import torch  # CUDA graphs serve decode on a GPU only (worker/cuda_graphs.py)

    assert bool(figures["cuda_graph_batch_sizes"]) == torch.cuda.is_available()


def test_bad_model_flags_fail_before_anything_starts(tmp_path, capsys):
    """The gateway's and `up`'s model flags are checked before any process starts (so in this
    process: nothing is started)."""
    from shoal.cli import main

    for args, needle in [
        (["gateway", "--redis-url", "redis://127.0.0.1:1/0", "--chat-template",
          str(tmp_path / "missing.jinja")], "cannot read the chat template"),
        (["up", "--chat-template", "{% for m in messages %}"], "does not compile"),
        (["up", "--model", str(tmp_path / "missing.gguf")], "does not exist"),
        (["gateway", "--redis-url", "redis://127.0.0.1:1/0", "--model", "default", "--model",
          "default"], "two models are named"),
        (["up", "--model", "default", "--model", "default", "--served-model-name", "x"],
         "apply to one --model"),
        (["up", "--enable-auto-tool-choice"], "go together"),
        (["gateway", "--redis-url", "redis://127.0.0.1:1/0", "--tool-call-parser", "hermes"],
         "go together"),
    ]:
        assert main(args) == 2, args
        assert needle in capsys.readouterr().err, args


def test_bad_tls_and_cors_flags_fail_before_the_gateway_starts(tmp_path, capsys):
    from shoal.cli import main

    (tmp_path / "junk.pem").write_text("not a certificate")
    gateway = ["gateway", "--redis-url", "redis://127.0.0.1:1/0"]
    for args, needle in [
        (["--ssl-keyfile", str(tmp_path / "junk.pem")], "go together"),
        (["--ssl-keyfile", str(tmp_path / "junk.pem"), "--ssl-certfile",
          str(tmp_path / "junk.pem")], "cannot load the TLS key and certificate"),
        (["--ssl-ca-certs", str(tmp_path / "junk.pem")], "needs --ssl-keyfile"),
        (["--allowed-origins", "https://a.example"], "not JSON"),
        (["--allowed-headers", '{"a": 1}'], "JSON list of strings"),
    ]:
        try:
            code = main([*gateway, *args])
        except SystemExit as e:  # argparse's own errors
            code = e.code
        assert code == 2 and needle in capsys.readouterr().err, args


def test_tracing_without_its_exporter_fails_before_anything_starts(monkeypatch, capsys):
    """--otlp-traces-endpoint with an exporter that is not installed (OTLP over gRPC: shoal's
    tracing extra brings the HTTP one) is a CLI error naming the extra, in every part that
    takes it; nothing starts."""
    import importlib.util

    from shoal.cli import main

    if importlib.util.find_spec("opentelemetry.exporter.otlp.proto.grpc") is not None:
        pytest.skip("the gRPC exporter is installed here")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    redis_args = ["--redis-url", "redis://127.0.0.1:1/0"]
    for args in (["up"], ["gateway", *redis_args], ["scheduler", *redis_args]):
        assert main([*args, "--otlp-traces-endpoint", "http://127.0.0.1:1"]) == 2, args
        assert "pip install 'shoal[tracing]'" in capsys.readouterr().err, args
    # OpenTelemetry's variable turns tracing on without the flag.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:1")
    assert main(["scheduler", *redis_args]) == 2
    assert "pip install 'shoal[tracing]'" in capsys.readouterr().err


def test_up_hands_the_engine_flags_to_its_workers(monkeypatch):
    """`shoal up` starts workers with the engine flags it was given (--enforce-eager among
    them: vLLM's name for serving without CUDA graphs)."""
    import shoal.fleet
    from shoal.cli import main

    seen = {}

    def fake_up(host, port, workers, redis_url, worker_args, *rest):
        seen["args"] = worker_args
        return 0

    monkeypatch.setattr(shoal.fleet, "up", fake_up)
    assert main(["up", "--enforce-eager", "--no-enable-prefix-caching", "--dtype", "float32"]) == 0
    args = seen["args"]
    assert "--enforce-eager" in args and "--no-enable-prefix-caching" in args
    assert args[args.index("--dtype") + 1] == "float32"
    assert main(["up"]) == 0 and "--enforce-eager" not in seen["args"]


def test_up_gives_the_served_names_to_gateway_and_workers(monkeypatch, tmp_path):
    """`shoal up --served-model-name A B`: the gateway answers to both names, the workers
    advertise the first (the name requests are matched to them by); the chat template goes to
    the gateway, which formats chats. With several `--model`s, each gets workers of its own."""
    import shoal.fleet
    from shoal.cli import main

    seen = {}

    def fake_up(host, port, workers, redis_url, worker_args, threads, metrics_port_base, jobs,
                policy, gateway_args, models, scheduler_args):
        seen["worker"], seen["gateway"], seen["models"] = worker_args, gateway_args, models
        seen["scheduler"] = scheduler_args
        return 0

    monkeypatch.setattr(shoal.fleet, "up", fake_up)
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert main(["up", "--served-model-name", "smol", "helper", "--chat-template",
                 str(template)]) == 0
    assert seen["worker"][-2:] == ["--served-model-name", "smol"]
    assert seen["gateway"] == ["--served-model-name", "smol", "helper",
                               "--chat-template", str(template)]
    # Several models: each its own workers, named by its file.
    from shoal.model_files import default_model_path

    other = tmp_path / "Other-Model.gguf"
    other.symlink_to(default_model_path())
    assert main(["up", "--model", str(default_model_path()), "--model", str(other)]) == 0
    assert seen["models"] == [str(default_model_path()), str(other)]
    assert "--model" not in seen["worker"] and seen["gateway"] == []
    # Tracing goes to the gateway and the scheduler.
    assert main(["up", "--otlp-traces-endpoint", "http://collector:4318/v1/traces"]) == 0
    assert seen["gateway"] == seen["scheduler"] == [
        "--otlp-traces-endpoint", "http://collector:4318/v1/traces"]
    # The stream interval is the scheduler's alone; 0 tokens is refused.
    assert main(["up", "--stream-interval", "4"]) == 0
    assert seen["scheduler"] == ["--stream-interval", "4"] and seen["gateway"] == []
    with pytest.raises(SystemExit):
        main(["up", "--stream-interval", "0"])
    # Loading LoRA adapters at run time is the gateway's.
    assert main(["up", "--allow-runtime-lora-updating"]) == 0
    assert seen["gateway"] == ["--allow-runtime-lora-updating"] and seen["scheduler"] == []
    assert "--allow-runtime-lora-updating" not in seen["worker"]


def test_engine_argv_gives_a_worker_the_same_engine():
    """`shoal bench fleet` starts its worker with the engine flags it was given: parsed by `shoal
    worker`, they make the same engine configuration; defaults are left out."""
    from shoal.cli import _engine_argv, _engine_config, build_parser

    parser = build_parser()
    flags = ["--dtype", "float32", "--block-size", "32", "--max-num-seqs", "8",
             "--kv-cache-memory-fraction", "0.2", "--max-model-len", "1024", "--enforce-eager",
             "--no-enable-prefix-caching", "--quantization", "int8",
             "--speculative-config", '{"num_speculative_tokens": 3}']
    args = parser.parse_args(["bench", "fleet", *flags, "--rounds", "2", "--stream-interval", "4"])
    argv = _engine_argv(args)
    assert "--rounds" not in argv and "--stream-interval" not in argv
    worker = parser.parse_args(["worker", "--redis-url", "redis://x", *argv])
    assert _engine_config(worker) == _engine_config(args)
    assert _engine_config(worker) != _engine_config(parser.parse_args(["worker", "--redis-url", "x"]))
    assert _engine_argv(parser.parse_args(["bench", "fleet"])) == []


def test_bench_fleet_quick_runs_both_sides_in_turns(tmp_path):
    """The workload in-process and through a real fleet (Redis, scheduler, worker, gateway as
    processes), in turns: both generate every token of every request, and the share is the
    median of the rounds' ratios. The fleet's scheduler streams 2 tokens an event
    (`--stream-interval`): the client still gets every token (every other test's fleet
    streams one an event)."""
    from shoal.workloads import W64_QUICK, make_requests

    out = tmp_path / "fleet.json"
    r = _shoal("bench", "fleet", "--quick", "--rounds", "2", "--stream-interval", "2",
               "--output", str(out), timeout=600)
    assert r.returncode == 0, r.stderr
    figures = json.loads(out.read_text())
    assert figures["stream_interval"] == 2
    reqs = make_requests(W64_QUICK, 49152, 0)
    expected = sum(q.max_tokens for q in reqs)
    rounds = figures["rounds"]
    assert [x["order"] for x in rounds] == [["engine", "fleet"], ["fleet", "engine"]]
    for x in rounds:
        assert x["engine"]["generated_tokens"] == x["fleet"]["generated_tokens"] == expected
        for side in ("engine", "fleet"):  # the iterations that computed tokens, timed inside
            assert x[side]["iterations"] >= max(q.max_tokens for q in reqs)
            assert 0 < x[side]["engine_seconds"] <= x[side]["seconds"]
            # ... decode-only among them: W64-quick's outputs run past its prefills
            assert 0 < x[side]["decode_iterations"] < x[side]["iterations"]
            assert 0 < x[side]["decode_engine_seconds"] < x[side]["engine_seconds"]
        assert x["fleet_share"] == pytest.approx(
            x["fleet"]["generated_tokens_per_s"] / x["engine"]["generated_tokens_per_s"])
    assert figures["fleet_share"] == pytest.approx(sum(x["fleet_share"] for x in rounds) / 2)
    cpu = figures["fleet_cpu_seconds_per_run"]
    assert set(cpu) == {"scheduler", "worker", "gateway", "redis", "load generator"}
    assert cpu["worker"] > 0
    assert figures["worker_peak_rss_bytes"] > 100 << 20  # the worker holds the model
    assert "fleet / in-process" in r.stdout
    assert "request_finished" in out.with_suffix(".log").read_text()  # the fleet's logs


def test_bench_engine_quick_samples_and_speculates_when_asked(tmp_path):
    from shoal.workloads import W64_QUICK, make_requests

    out = tmp_path / "engine-sampled.json"
    r = _shoal("bench", "engine", "--quick", "--no-baseline", "--rounds", "1", "--temperature",
               "0.8", "--top-p", "0.9", "--speculative-config", '{"num_speculative_tokens": 3}',
               "--output", str(out), timeout=600)
    assert r.returncode == 0, r.stderr
    figures = json.loads(out.read_text())
    assert figures["sampling"] == {"temperature": 0.8, "top_p": 0.9}
    expected = sum(q.max_tokens for q in make_requests(W64_QUICK, 49152, 0))
    assert figures["shoal"]["generated_tokens"] == expected  # every request ran to max_tokens
    assert "temperature 0.8, top_p 0.9" in r.stdout
    assert figures["speculative"]["num_speculative_tokens"] == 3
    chat = figures["chat_single_stream"]  # greedy chat answers copy their prompts: drafts kept
    assert 0 < chat["accepted_tokens"] <= chat["draft_tokens"] and chat["generated_tokens"] > 0


def test_bench_engine_quick_reports_the_cost_of_quantization(tmp_path):
    out = tmp_path / "engine-w8a8.json"
    r = _shoal("bench", "engine", "--quick", "--no-baseline", "--rounds", "1", "--quantization",
               "w8a8", "--output", str(out), timeout=600)
    assert r.returncode == 0, r.stderr
    figures = json.loads(out.read_text())
    assert figures["quantization"] == "w8a8" and figures["transformers_static_batch8"] is None
    quality = figures["perplexity"]
    for key in ("reference", "quantized", "prefill_reference", "prefill_quantized"):
        assert 1.0 < quality[key] < 1000.0, quality  # perplexities of a real model on real text
    assert r.stdout.count("perplexity") == 2  # one token per iteration, and as one prompt


def test_bench_scheduler_writes_its_figures(tmp_path):
    out = tmp_path / "scheduler.json"
    r = subprocess.run([*shoal_command(), "bench", "scheduler", "--workers", "1,8",
                        "--requests", "40", "--max-plans", "60", "--output", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())
    assert [(row["workers"], row["requests"]) for row in rows] == [(1, 40), (8, 40)]
    for row in rows:
        assert row["plans"] > 1 and row["us_per_plan_median"] > 0 and row["plans_per_s"] > 0
        assert 0 < row["mean_running"] <= 40
    bad = subprocess.run([*shoal_command(), "bench", "scheduler", "--workers", "x"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--workers" in bad.stderr and "Traceback" not in bad.stderr


def test_dtype_auto_follows_the_cpus_bfloat16_instructions(monkeypatch):
    import torch

    from shoal.cli import build_parser
    from worker import cpu_ops
    from worker.config import resolve_dtype

    assert build_parser().parse_args(["generate", "hi"]).dtype == "auto"
    intel, amd = "GenuineIntel", "AuthenticAMD"
    for flags, vendor, expected in [
            ("flags\t: fpu avx512f avx512_vnni", amd, torch.float32),
            ("flags\t: fpu avx512f avx512_bf16", amd, torch.bfloat16),
            # an Intel core's vdpbf16ps does no more multiply-adds a cycle than float32's FMAs
            ("flags\t: fpu avx512f avx512_bf16 avx512_fp16", intel, torch.float32),
            ("flags\t: fpu amx_tile amx_bf16 avx512f avx512_bf16", intel, torch.bfloat16),
            ("Features\t: fp asimd bf16", None, torch.bfloat16),
            ("Features\t: fp asimd", None, torch.float32),
            (None, None, torch.bfloat16)]:
        monkeypatch.setattr(cpu_ops, "cpu_flags", lambda flags=flags: flags)
        monkeypatch.setattr(cpu_ops, "cpu_vendor", lambda vendor=vendor: vendor)
        assert resolve_dtype("auto", "cpu") == expected, (flags, vendor)
        assert resolve_dtype("float32", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype("float8", "cpu")


def test_prefix_caching_is_on_unless_turned_off():
    from shoal.cli import _engine_config, build_parser

    worker = ["worker", "--redis-url", "redis://127.0.0.1:1/0"]
    for argv, expected in ((worker, True), ([*worker, "--no-enable-prefix-caching"], False),
                           (["bench", "engine", "--enable-prefix-caching"], True)):
        args = build_parser().parse_args([*argv, "--dtype", "float32"])
        assert _engine_config(args).enable_prefix_caching is expected, argv
    up = build_parser().parse_args(["up", "--no-enable-prefix-caching"])
    assert up.enable_prefix_caching is False
