"""Decode iterations through worker.cuda_graphs: padded to a captured batch size, fed from static
buffers, the same tokens as the eager path.

On a GPU the graphs are captured and replayed; on the CPU the same padded forward runs eagerly on
the static buffers (`capture=False`) with the Triton kernels interpreted (tests/conftest.py sets
TRITON_INTERPRET=1), which checks the padding and the staging of block tables.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from shoal.messages import NewRequest  # noqa: E402
from shoal.sampling_params import SamplingParams  # noqa: E402
from tests.conftest import make_engine, random_weights, tiny_config  # noqa: E402
from worker.cuda_graphs import DecodeGraphs, batch_sizes  # noqa: E402
from worker.offline import generate  # noqa: E402

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs CUDA or TRITON_INTERPRET=1")
DEVICE = "cuda" if CUDA else "cpu"


def test_batch_sizes_ladder():
    assert batch_sizes(1) == [1]
    assert batch_sizes(5) == [1, 2, 4, 5]
    assert batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert batch_sizes(256)[-3:] == [240, 248, 256] and len(batch_sizes(256)) == 35


def _requests(vocab: int, g: torch.Generator) -> list[NewRequest]:
    """Seven greedy requests of different prompt lengths (1-40 tokens) and output lengths, so
    decode batches shrink from 7 through every size to 1 and cross block boundaries (16)."""
    out = []
    for i, (prompt, new) in enumerate([(3, 2), (40, 18), (17, 9), (1, 17), (16, 5), (25, 12),
                                       (8, 16)]):
        ids = torch.randint(2, vocab, (prompt,), generator=g).tolist()
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        out.append(NewRequest(f"r{i}", ids, params))
    return out


def _run(engine, requests) -> dict[str, list[int]]:
    return {r: c.token_ids for r, c in generate(engine, requests).items()}


def test_padded_decode_gives_the_eager_tokens():
    """A small random model (shapes only): the graphs' padded decode iterations (batches of
    1-7 padded to 1, 2, 4, 8) give every request the tokens the eager path gives, and the static
    path served the decode iterations."""
    cfg = tiny_config(head_dim=16, num_heads=4, num_kv_heads=2, hidden_size=64, vocab_size=256)
    model = (cfg, random_weights(cfg, seed=5))
    requests = _requests(cfg.vocab_size, torch.Generator().manual_seed(6))
    kw = dict(attention_backend="triton", block_size=16, kv_cache_bytes=4 << 20, device=DEVICE,
              max_num_seqs=8)
    eager = _run(make_engine(model, enforce_eager=True, **kw), requests)
    engine = make_engine(model, **kw)
    if not CUDA:  # no capture here: the same static, padded forward, run eagerly
        engine.decode_graphs = DecodeGraphs(engine.model, engine.kv_cache, 8,
                                            engine.max_model_len, capture=False)
    assert engine.decode_graphs is not None and engine.decode_graphs.sizes == [1, 2, 4, 8]
    graphs = _run(engine, requests)
    assert graphs == eager
    assert sum(len(t) for t in eager.values()) == 79
    # Every iteration after the first few prefills is decode-only: most went through the graphs.
    assert engine.decode_graphs.replays >= 12


def test_no_graphs_on_the_cpu_or_when_eager():
    cfg = tiny_config(head_dim=16)
    model = (cfg, random_weights(cfg))
    assert make_engine(model, device="cpu").decode_graphs is None
    if CUDA:
        kw = dict(attention_backend="triton", block_size=16, device="cuda")
        assert make_engine(model, enforce_eager=True, **kw).decode_graphs is None
        assert make_engine(model, attention_backend="torch", device="cuda").decode_graphs is None


@pytest.mark.skipif(not CUDA, reason="captures CUDA graphs: needs a GPU")
def test_real_model_graphs_give_the_eager_tokens(model_path, tokenizer):
    """SmolLM2 on the GPU: greedy tokens through captured graphs equal the eager path's for a
    batch of prompts (decode batches of 3, padded to 4). In float32: a padded batch may take
    another GEMM kernel, and bfloat16's rounding could then flip a near-tie."""
    from worker.config import EngineConfig
    from worker.engine import Engine

    prompts = ["The capital of France is", "def fibonacci(n):",
               "Once upon a time, in a small village by the sea, there lived"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    requests = [NewRequest(f"r{i}", tokenizer.encode(p, add_special_tokens=False), params)
                for i, p in enumerate(prompts)]
    tokens = {}
    for eager in (True, False):
        engine = Engine.from_path(model_path, EngineConfig(
            dtype=torch.float32, device="cuda", kv_cache_bytes=64 << 20, max_num_seqs=16,
            enforce_eager=eager))
        tokens[eager] = _run(engine, requests)
        assert (engine.decode_graphs is None) == eager
    assert engine.decode_graphs.replays >= 23
    assert tokens[False] == tokens[True]
