"""Every fast path of the engine (C++ kernels, prepacked weights, int8) on the real model, against
the plain torch reference path."""

from __future__ import annotations

import pytest
import torch

from shoal.messages import NewRequest
from shoal.sampling_params import SamplingParams
from tests.conftest import make_engine
from worker import cpu_ops
from worker.loader import load_model
from worker.offline import generate
from worker.perplexity import REFERENCE_TEXT, decode_perplexity, reference_text

INT8_PERPLEXITY_BOUND = 1.02  # int8 perplexity at most 2% above bfloat16's (docs/engine.md)


@pytest.fixture(scope="module")
def bf16_model(model_path):
    return load_model(model_path, torch.bfloat16)


def _requests(tokenizer, max_tokens: int) -> list[NewRequest]:
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village",
             " ".join(f"Item {i} of the long list." for i in range(60))]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [NewRequest(f"r{i}", tokenizer.encode(t, add_special_tokens=False), params)
            for i, t in enumerate(texts)]


def _run(model, tokenizer, **kw):
    engine = make_engine(model, keep_logits=False, **kw)
    # A chunk budget below the longest prompt: chunked prefill (cached prefix) is exercised too.
    out = generate(engine, _requests(tokenizer, 24))
    assert engine.num_free_blocks == engine.num_total_blocks
    return {r: c.token_ids for r, c in out.items()}


@pytest.mark.skipif(not cpu_ops.load(), reason="the C++ kernels did not build here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_paths_give_the_reference_tokens(fp32_model, bf16_model, tokenizer, dtype):
    model = fp32_model if dtype == torch.float32 else bf16_model
    fast = _run(model, tokenizer, dtype=dtype, max_num_batched_tokens=256)
    reference = _run(model, tokenizer, dtype=dtype, max_num_batched_tokens=256, fast_paths=False)
    assert all(len(t) == 24 for t in fast.values())
    assert fast == reference


@pytest.mark.skipif(not REFERENCE_TEXT.exists(), reason=f"{REFERENCE_TEXT} is not on this machine")
def test_int8_is_deterministic_and_within_its_perplexity_bound(bf16_model, tokenizer):
    once = _run(bf16_model, tokenizer, dtype=torch.bfloat16, quantization="int8")
    again = _run(bf16_model, tokenizer, dtype=torch.bfloat16, quantization="int8")
    assert once == again
    ids = tokenizer.encode(reference_text(), add_special_tokens=False)[:160]
    ppl = {q: decode_perplexity(make_engine(bf16_model, dtype=torch.bfloat16, quantization=q), ids)
           for q in ("none", "int8")}
    print(f"perplexity on {REFERENCE_TEXT} ({len(ids)} tokens): bfloat16 {ppl['none']:.3f}, "
          f"int8 {ppl['int8']:.3f}")
    assert 1.0 < ppl["none"] < 100.0  # a real model on real text, not noise
    assert ppl["int8"] <= ppl["none"] * INT8_PERPLEXITY_BOUND
