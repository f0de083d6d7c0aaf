"""`shoal bench engine`: workload W64 in-process, against request-level batching in transformers.

W64: 64 requests submitted at once, prompt lengths uniform in [32, 256] tokens of random ids,
output lengths uniform in [1, 64], forced (`ignore_eos`), greedy, seeded, run `--rounds` times on
an engine warmed up by one run of other such requests (the median run is reported). The same
requests then run through transformers `generate` in static batches of 8 (request-level
batching: a batch runs until its longest request is done; the Orca paper's baseline), in the same
process, in bfloat16. The run also times decode iterations at batch 1, 8, 32 and 64,
single-stream decode (a 128-token prompt, 128 tokens out; and three real chat prompts; each
`--rounds` times, the median reported) and one prefill iteration. With
`--quantization` it also reports the perplexity of a real text, quantized against unquantized,
one token per iteration and as one prompt (worker/perplexity.py).
"""

from __future__ import annotations

import resource
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch

from shoal.figures import write_figures
from shoal.messages import IterationPlan, NewRequest
from shoal.model_files import load_transformers_model
from shoal.sampling_params import SamplingParams
from shoal.workloads import (
    W64,
    W64_QUICK,
    BenchRequest,
    make_requests,
    with_sampling,
    with_shared_prefix,
)
from worker import ops
from worker.engine import Engine
from worker.offline import stream

# The reference: transformers static batching in bfloat16, whatever dtype shoal serves in.
BASELINE_DTYPE = torch.bfloat16


def to_engine_requests(reqs: list[BenchRequest]) -> list[NewRequest]:
    """EOS ignored: every request generates exactly its `max_tokens`, greedy or as it samples."""
    return [NewRequest(r.request_id, r.prompt_token_ids,
                       SamplingParams(max_tokens=r.max_tokens, temperature=r.temperature,
                                      top_p=r.top_p, seed=r.seed, ignore_eos=True))
            for r in reqs]


def run_workload(engine: Engine, reqs: list[NewRequest]) -> dict[str, float]:
    """All requests submitted at t=0; returns throughput and per-token latency figures, and the
    iterations that computed tokens and their seconds (`engine_seconds`; the rest of `seconds`
    went to the admission loop), and those of the decode-only ones among them. The prefix cache
    is emptied first: a run repeating another's prompts computes them again."""
    engine.reset_prefix_cache()
    hits = engine.prefix_cache_hits
    iterations, engine_seconds = engine.iterations, engine.iteration_seconds
    decodes, decode_seconds = engine.decode_iterations, engine.decode_iteration_seconds
    t0 = time.perf_counter()
    finished_at: dict[str, float] = {}
    generated = 0
    for out in stream(engine, reqs):
        if out.token_id is not None:
            generated += 1
        if out.finish_reason is not None:
            finished_at[out.request_id] = time.perf_counter() - t0
    elapsed = time.perf_counter() - t0
    per_token = [finished_at[r.request_id] / r.params.max_tokens for r in reqs]
    return {
        "generated_tokens": generated,
        "seconds": elapsed,
        "generated_tokens_per_s": generated / elapsed,
        "requests_per_s": len(reqs) / elapsed,
        "median_latency_per_output_token_s": statistics.median(per_token),
        "prefix_cache_hit_tokens": engine.prefix_cache_hits - hits,
        "iterations": engine.iterations - iterations,
        "engine_seconds": engine.iteration_seconds - engine_seconds,
        "decode_iterations": engine.decode_iterations - decodes,
        "decode_engine_seconds": engine.decode_iteration_seconds - decode_seconds,
    }


def decode_throughput(engine: Engine, batch: int, prompt_len: int, steps: int) -> float:
    """Tokens/s of decode-only iterations with `batch` requests of `prompt_len`-token contexts,
    prefilled afresh, until each has generated `steps` more tokens (`steps` iterations, fewer
    where speculative decoding keeps drafts). Prefilled afresh: calls repeat prompts, and
    requests built from an earlier call's cached blocks decoded 7.5% slower at batch 64 (their
    blocks lie where that call left them and their new ones come from elsewhere;
    docs/benchmarks.md, session 19)."""
    engine.reset_prefix_cache()
    reqs = [NewRequest(f"d{batch}-{i}", [(7 * i + j) % 1000 + 10 for j in range(prompt_len)],
                       SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True))
            for i in range(batch)]
    engine.step(IterationPlan(admit=reqs))
    while any(s.num_uncomputed_tokens > 1 for s in engine.running.values()):
        engine.step()  # finish chunked prefills
    engine.step()  # the first decode of each: warm, not counted
    t0 = time.perf_counter()
    generated = 0
    while engine.running:
        generated += sum(o.token_id is not None for o in engine.step().outputs)
    return generated / (time.perf_counter() - t0)


# Real chat prompts for single-stream decode: one an answer copies much of (prompt lookup's
# best case), one it copies a little of, one it copies nothing of.
CHAT_PROMPTS = (
    "Fix the grammar of this text and repeat it in full: 'The cat sit on the mat and it were "
    "very happy, because the sun are warm and the birds is singing in the trees all day long. "
    "Then the dog come home and eat it dinner.'",
    "Rename the variable x to count in this code and show the whole code:\ndef f(items):\n"
    "    x = 0\n    for item in items:\n        if item > 0:\n            x += item\n    return x\n",
    "What is the capital of France? Tell me about its history.",
)


def chat_single_stream(path: Path, engine: Engine, max_tokens: int) -> dict:
    """Single-stream decode on the `CHAT_PROMPTS` (chat template applied, greedy, up to
    `max_tokens` each, stopping at EOS): tokens/s after each answer's first token (the prefill's)
    over the three, and the speculative drafts checked and kept."""
    from shoal.model_files import load_tokenizer

    tok = load_tokenizer(path)
    drafts, kept = engine.spec_draft_tokens, engine.spec_accepted_tokens
    generated, elapsed = 0, 0.0
    for i, text in enumerate(CHAT_PROMPTS):
        chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok.encode(chat, add_special_tokens=False)
        engine.reset_prefix_cache()
        req = NewRequest(f"chat{i}", ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        first = None  # decode time: from the first token (after the prefill) to the last
        for out in stream(engine, [req]):
            if out.token_id is not None:
                if first is None:
                    first = time.perf_counter()
                else:
                    generated += 1
        elapsed += time.perf_counter() - first
    return {"generated_tokens": generated, "generated_tokens_per_s": generated / elapsed,
            "draft_tokens": engine.spec_draft_tokens - drafts,
            "accepted_tokens": engine.spec_accepted_tokens - kept}


def prefill_throughput(engine: Engine, num: int, prompt_len: int) -> float:
    """Tokens/s of one iteration prefilling `num` prompts of `prompt_len` tokens (none from the
    prefix cache)."""
    engine.reset_prefix_cache()
    reqs = [NewRequest(f"p{i}", [(3 * i + j) % 1000 + 10 for j in range(prompt_len)],
                       SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            for i in range(num)]
    t0 = time.perf_counter()
    engine.step(IterationPlan(admit=reqs))
    return num * prompt_len / (time.perf_counter() - t0)


def quantization_perplexity(path: Path, engine: Engine, num_tokens: int) -> dict:
    """Perplexity of `engine` (quantized) and of the same model unquantized over the first
    `num_tokens` tokens of the reference text, one token per iteration (`decode`: the weight-only
    path) and as one prompt (`prefill`: w8a8's int8 activations; unquantized otherwise)."""
    from dataclasses import replace

    from shoal.model_files import load_tokenizer
    from worker.perplexity import (
        REFERENCE_TEXT,
        decode_perplexity,
        prefill_perplexity,
        reference_text,
    )

    ids = load_tokenizer(path).encode(reference_text(), add_special_tokens=False)[:num_tokens]
    reference = Engine.from_path(path, replace(engine.cfg, quantization="none",
                                               kv_cache_bytes=64 << 20))
    return {"text": str(REFERENCE_TEXT), "tokens": len(ids),
            "reference_dtype": str(engine.cfg.dtype).removeprefix("torch."),
            "reference": decode_perplexity(reference, ids),
            "quantized": decode_perplexity(engine, ids),
            "prefill_reference": prefill_perplexity(reference, ids),
            "prefill_quantized": prefill_perplexity(engine, ids)}


def transformers_static_batches(path: Path, dtype: torch.dtype, reqs: list[NewRequest],
                                batch_size: int = 8) -> dict[str, float]:
    """Request-level batching baseline: transformers `generate` on left-padded static batches.

    Each batch runs until its longest request is done; only each request's own `max_tokens`
    count as generated tokens.
    """
    model = load_transformers_model(path, dtype)
    pad = 0

    def run(batch: list[NewRequest]) -> None:
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            n = len(r.prompt_token_ids)
            ids[i, width - n :] = torch.tensor(r.prompt_token_ids)
            mask[i, width - n :] = 1
        new = max(r.params.max_tokens for r in batch)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=pad)

    run(reqs[:2])  # warm-up
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        run(reqs[i : i + batch_size])
    elapsed = time.perf_counter() - t0
    generated = sum(r.params.max_tokens for r in reqs)
    return {"generated_tokens": generated, "seconds": elapsed,
            "generated_tokens_per_s": generated / elapsed}


def run_engine_bench(path: Path, engine: Engine, load_s: float, quick: bool, baseline: bool,
                     output: str, seed: int, rounds: int = 3, temperature: float = 0.0,
                     top_p: float = 1.0, shared_prefix: int = 0) -> dict:
    """Run the benchmark on `engine` (loaded from `path` in `load_s` seconds), print a table and
    write the figures as JSON to `output`. W64's requests sample at `temperature` within
    `top_p` (greedy at 0, the default), each prompt behind `shared_prefix` tokens they all share
    (`shoal.workloads.with_shared_prefix`; the baseline's too); the other measures and the
    baseline are greedy.

    The workload runs `rounds` times on the warm engine and the median run (by generated
    tokens/s) is reported, all of them in the JSON: one 3.5-second run of W64 on a shared 2-core
    host moved by 5-10% from run to run (docs/benchmarks.md, session 14)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    cfg = engine.cfg
    vocab = engine.model_cfg.vocab_size
    workload = W64_QUICK if quick else W64
    # Warm up on a run of the workload itself (other prompts, the same spread of lengths), so
    # that every counted run follows one of its own shape, as a serving engine's do ("once
    # warm", as the issue's vLLM figure). Warmed up on W64-quick alone, the first W64 run was
    # once the slowest of three (586.7 against 601.8 and 597.5 tokens/s, 2-core Zen 5).
    def requests(s: int, prefix: str) -> list[NewRequest]:
        reqs = with_sampling(make_requests(workload, vocab, s, prefix), temperature, top_p)
        return to_engine_requests(with_shared_prefix(reqs, shared_prefix, vocab, seed))

    with console.status("warming up"):
        run_workload(engine, requests(seed + 1, "warm"))
    runs = []
    for i in range(rounds):
        with console.status(f"{workload.name} through the engine, run {i + 1} of {rounds}"):
            runs.append(run_workload(engine, requests(seed, f"w{i}-")))
    ours = sorted(runs, key=lambda r: r["generated_tokens_per_s"])[(rounds - 1) // 2]
    batches = (1, 8) if quick else (1, 8, 32, 64)
    steps = 4 if quick else 32
    decode = {}
    with console.status("decode throughput"):
        for b in batches:
            decode[str(b)] = decode_throughput(engine, b, 128, steps)
    # Single streams `rounds` times too, the median reported: one run of these few seconds moved
    # by up to 25% within minutes on a shared host (docs/benchmarks.md, session 23).
    with console.status("single-stream decode"):
        drafts, kept = engine.spec_draft_tokens, engine.spec_accepted_tokens
        singles = [decode_throughput(engine, 1, 128, 8 if quick else 128) for _ in range(rounds)]
        single = statistics.median(singles)
        single_spec = {"draft_tokens": engine.spec_draft_tokens - drafts,
                       "accepted_tokens": engine.spec_accepted_tokens - kept}
        chats = [chat_single_stream(path, engine, 8 if quick else 128) for _ in range(rounds)]
        chat = sorted(chats, key=lambda c: c["generated_tokens_per_s"])[(rounds - 1) // 2]
    quality = None
    if cfg.quantization != "none":
        with console.status("perplexity, quantized against unquantized"):
            quality = quantization_perplexity(path, engine, 48 if quick else 512)
    with console.status("prefill throughput"):
        prefill = prefill_throughput(engine, 2 if quick else 8, 64 if quick else 256)
    base = None
    if baseline:
        with console.status("W64 through transformers static batches of 8"):
            reqs = with_shared_prefix(make_requests(workload, vocab, seed), shared_prefix, vocab,
                                      seed)
            base = transformers_static_batches(path, BASELINE_DTYPE, to_engine_requests(reqs))
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    table = Table(title=f"shoal bench engine ({'quick' if quick else 'W64'}, {str(cfg.dtype).removeprefix('torch.')}, "
                        f"{torch.get_num_threads()} threads)")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row(f"shoal generated tokens/s (median of {rounds} runs)",
                  f"{ours['generated_tokens_per_s']:.1f}")
    sampling = f"temperature {temperature}, top_p {top_p}, seeded" if temperature else "greedy"
    table.add_row("W64 sampling", sampling)
    if shared_prefix:
        table.add_row("shared prompt prefix (tokens); found cached per run",
                      f"{shared_prefix}; {ours['prefix_cache_hit_tokens']}")
    if rounds > 1:
        table.add_row("shoal generated tokens/s, each run",
                      " / ".join(f"{r['generated_tokens_per_s']:.1f}" for r in runs))
    table.add_row("shoal requests/s", f"{ours['requests_per_s']:.2f}")
    table.add_row("shoal median latency per output token (ms)",
                  f"{ours['median_latency_per_output_token_s'] * 1e3:.1f}")
    if base:
        table.add_row("transformers static batches of 8 (bfloat16), generated tokens/s",
                      f"{base['generated_tokens_per_s']:.1f}")
        table.add_row("ratio shoal / transformers",
                      f"{ours['generated_tokens_per_s'] / base['generated_tokens_per_s']:.1f}x")
    for b, v in decode.items():
        table.add_row(f"decode tokens/s at batch {b}", f"{v:.1f}")
    each = f"median of {rounds} runs" if rounds > 1 else "one run"
    table.add_row(f"single-stream decode tokens/s (128-token prompt, 128 out; {each})",
                  f"{single:.1f}")
    table.add_row(f"single-stream decode tokens/s, {len(CHAT_PROMPTS)} chat prompts (greedy, "
                  f"to EOS or {8 if quick else 128}; {each})",
                  f"{chat['generated_tokens_per_s']:.1f}")
    spec = cfg.speculative
    if spec is not None:
        table.add_row("speculative decoding", f"{spec.method}, {spec.num_speculative_tokens} "
                      f"tokens, lookup {spec.prompt_lookup_min}-{spec.prompt_lookup_max}, off "
                      f"above {spec.disable_by_batch_size} decodes")
        table.add_row("drafts kept / checked: single stream; chat prompts",
                      f"{single_spec['accepted_tokens']} / {single_spec['draft_tokens']}; "
                      f"{chat['accepted_tokens']} / {chat['draft_tokens']}")
    else:
        table.add_row("speculative decoding", "off")
    if quality:
        for path_name, key in (("one token per iteration", ""), ("as one prompt", "prefill_")):
            table.add_row(f"perplexity, {quality['tokens']} tokens of {quality['text']} "
                          f"{path_name}",
                          f"{cfg.quantization} {quality[key + 'quantized']:.3f} / "
                          f"{quality['reference_dtype']} {quality[key + 'reference']:.3f}")
    table.add_row("prefill tokens/s", f"{prefill:.0f}")
    table.add_row("quantization", cfg.quantization)
    table.add_row("prefix caching", "on" if cfg.enable_prefix_caching else "off")
    amx = engine.model.kernels and ops.amx_available()
    bf16_pairs = engine.model.kernels and ops.dp_linear_available()
    kernels = ("yes, with AMX tiles" if amx else "yes, with AVX512_BF16" if bf16_pairs
               else "yes") if engine.model.kernels else "no (torch path)"
    table.add_row("C++ kernels", kernels)
    levels, projections, level_rows = engine.model.levels_served()
    table.add_row("projections read from the file's 4-bit levels (bit for bit)",
                  f"{levels} of {projections}, iterations of <= {level_rows} rows" if levels
                  else "none")
    stack_rows = engine.model.stack_max_rows  # 0 where decode_stack does not serve
    table.add_row("all layers in one call (shoal::decode_stack)",
                  f"iterations of <= {stack_rows} rows" if stack_rows else "no")
    table.add_row("attention backend", engine.model.attention.name)
    graphs = engine.decode_graphs
    graph_sizes = graphs.sizes if graphs is not None else []
    table.add_row("CUDA graphs for decode",
                  f"batches of 1-{graph_sizes[-1]} ({len(graph_sizes)} graphs)" if graph_sizes
                  else "no")
    table.add_row("model load, kernel build included (s)", f"{load_s:.1f}")
    table.add_row("K/V blocks", f"{engine.num_total_blocks} x {cfg.block_size} tokens")
    table.add_row("peak resident memory (MiB)", f"{peak_rss / 2**20:.0f}")
    console.print(table)

    figures = {
        "workload": "W64-quick" if quick else "W64", "seed": seed,
        "sampling": {"temperature": temperature, "top_p": top_p},
        "shared_prefix_tokens": shared_prefix,
        "prefix_caching": cfg.enable_prefix_caching,
        "dtype": str(cfg.dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
        "shoal": ours, "shoal_runs": runs, "transformers_static_batch8": base,
        "decode_tokens_per_s": decode, "single_stream_decode_tokens_per_s": single,
        "single_stream_runs": singles, "single_stream_speculation": single_spec,
        "chat_single_stream": chat,
        "chat_single_stream_runs": [c["generated_tokens_per_s"] for c in chats],
        "speculative": None if cfg.speculative is None else asdict(cfg.speculative),
        "quantization": cfg.quantization, "perplexity": quality,
        "cpu_kernels": engine.model.kernels, "amx": amx, "avx512_bf16": bf16_pairs,
        "q4_levels": {"projections": levels, "of": projections, "max_rows": level_rows},
        "decode_stack_max_rows": stack_rows,
        "attention_backend": engine.model.attention.name,
        "cuda_graph_batch_sizes": graph_sizes,
        "prefill_tokens_per_s": prefill,
        "model_load_seconds": load_s, "peak_rss_bytes": peak_rss,
    }
    console.print(f"figures written to {write_figures(figures, output)}")
    return figures


def run_infinite_bench(path: Path, cfg, tokens: int, windows: list[int], output: str) -> dict:
    """`shoal bench infinite`: single-stream decode tokens/s generating `tokens` tokens, plainly
    (a window large enough for all of them) and past a window with `shift` and `reevaluate`
    (attention sinks, n_keep 4), for each window. Prints a table and writes JSON to `output`."""
    from dataclasses import replace

    from rich.console import Console
    from rich.table import Table

    from worker.loader import load_model

    model_cfg, weights = load_model(path, cfg.dtype)
    prompt = [(7 * j) % 1000 + 10 for j in range(32)]

    def run(window: int, mode: str) -> float:
        engine = Engine(model_cfg, weights, replace(cfg, max_model_len=window))
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True,
                                context_overflow=mode)
        engine.step(IterationPlan(admit=[NewRequest("x", prompt, params)]))
        t0 = time.perf_counter()
        n = 0
        while engine.running:
            n += len(engine.step().outputs)
        return n / (time.perf_counter() - t0)

    console = Console()
    rows = []
    with console.status("decoding") as status:
        plain_window = min(model_cfg.max_position_embeddings, len(prompt) + tokens + 1)
        status.update(f"plain decode of {tokens} tokens")
        plain = run(plain_window, "error")
        for w in windows:
            for mode in ("shift", "reevaluate"):
                status.update(f"{mode}, window {w}")
                rows.append({"window": w, "mode": mode, "tokens_per_s": run(w, mode)})
    table = Table(title=f"shoal bench infinite ({tokens} tokens, {str(cfg.dtype).removeprefix('torch.')})")
    for col in ("window", "context overflow", "tokens/s", "overhead against plain decode"):
        table.add_column(col, justify="right")
    table.add_row(str(plain_window), "none (plain decode)", f"{plain:.1f}", "")
    for r in rows:
        r["overhead"] = plain / r["tokens_per_s"] - 1
        table.add_row(str(r["window"]), r["mode"], f"{r['tokens_per_s']:.1f}", f"{r['overhead']:+.1%}")
    console.print(table)
    figures = {"tokens": tokens, "dtype": str(cfg.dtype).removeprefix("torch."),
               "plain": {"window": plain_window, "tokens_per_s": plain}, "overflow": rows}
    console.print(f"figures written to {write_figures(figures, output)}")
    return figures
