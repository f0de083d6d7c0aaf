"""Greedy tokens and per-step logits of a few prompts, in a process of its own so that a
tensor-parallel group (worker/parallel.py) can start there: `python -m tests.tp_probe N OUT.pt`
with N ranks. tests/test_tensor_parallel.py runs it and compares with one rank in-process."""

from __future__ import annotations

import sys

import torch

from shoal.messages import IterationPlan, NewRequest
from shoal.model_files import default_model_path
from shoal.sampling_params import SamplingParams
from worker.config import EngineConfig

PROMPTS = [[504, 3458, 282, 4649, 314], [1012, 13, 1052, 200, 17, 9, 4, 330, 57, 812, 44, 21]]
MAX_TOKENS = 8
CONFIG = EngineConfig(dtype=torch.float32, kv_cache_bytes=64 << 20, max_num_batched_tokens=8)


def run(engine) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
    """Each prompt's greedy tokens and `[MAX_TOKENS, vocab]` float32 logits (chunked prefill
    included: 8 tokens per iteration)."""
    engine.keep_logits = True
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    plan = IterationPlan(admit=[NewRequest(f"p{i}", p, params) for i, p in enumerate(PROMPTS)])
    tokens: dict[str, list[int]] = {f"p{i}": [] for i in range(len(PROMPTS))}
    logits: dict[str, list[torch.Tensor]] = {r: [] for r in tokens}
    while True:
        result = engine.step(plan)
        plan = None
        for out in result.outputs:
            if out.token_id is not None:
                tokens[out.request_id].append(out.token_id)
                logits[out.request_id].append(engine.last_logits[out.request_id].clone())
        if not engine.running:
            return tokens, {r: torch.stack(v) for r, v in logits.items()}


def main(size: int, out: str) -> None:
    from worker.engine import Engine
    from worker.parallel import load_shard, start_group

    path = default_model_path()
    group = start_group(size, path, CONFIG, threads=1)
    try:
        model_cfg, weights = load_shard(path, CONFIG.dtype, group.tp)
        engine = Engine(model_cfg, weights, CONFIG, tp=group.tp)
        torch.save({"blocks": engine.num_total_blocks, "result": run(engine)}, out)
        engine.model.stop_followers()
    finally:
        group.stop()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
