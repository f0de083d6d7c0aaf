"""The sampler against exact distributions, and SamplingParams validation."""

from __future__ import annotations

import pytest
import torch

from shoal.sampling_params import InvalidSamplingParams, SamplingParams
from worker.sampler import Sampler


def _draw(logits, params, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(logits.shape[-1])
    for _ in range(n):
        tok, _ = Sampler()(logits.clone(), [params], [gen])
        counts[tok[0]] += 1
    return counts / n


def test_temperature_sampling_follows_softmax():
    logits = torch.randn(1, 12) * 2
    p = SamplingParams(temperature=0.7, seed=0)
    freq = _draw(logits, p, 4000)
    expected = torch.softmax(logits[0] / 0.7, -1)
    assert (freq - expected).abs().max() < 0.03


def test_top_k_and_top_p_cut_the_tail():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]]))
    freq = _draw(logits, SamplingParams(temperature=1.0, top_k=2), 2000)
    assert freq[2:].sum() == 0 and abs(freq[0] - 0.4 / 0.7) < 0.05
    freq = _draw(logits, SamplingParams(temperature=1.0, top_p=0.8), 2000)
    # 0.4 + 0.3 < 0.8, adding 0.15 reaches it: three tokens stay.
    assert freq[3:].sum() == 0 and freq[2] > 0


def test_greedy_rows_and_logprobs():
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0.0, logprobs=True), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0.0)]
    gens = [None, torch.Generator().manual_seed(1), None]
    tokens, logprobs = Sampler()(logits.clone(), params, gens)
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())
    assert logprobs[0] == pytest.approx(float(torch.log_softmax(logits[0], -1).max()), abs=1e-5)
    assert logprobs[1] is None and logprobs[2] is None


def test_same_seed_same_tokens_regardless_of_neighbours():
    logits = torch.randn(4, 100)
    p = SamplingParams(temperature=1.0, seed=5)
    alone, _ = Sampler()(logits[:1].clone(), [p], [torch.Generator().manual_seed(5)])
    others = [SamplingParams(temperature=1.3, top_p=0.5, seed=i) for i in range(3)]
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    mixed, _ = Sampler()(torch.cat([logits[1:3], logits[:1], logits[3:]]).clone(),
                         [others[0], others[1], p, others[2]],
                         [gens[0], gens[1], torch.Generator().manual_seed(5), gens[2]])
    assert mixed[2] == alone[0]


@pytest.mark.parametrize("kw", [{"max_tokens": 0}, {"temperature": -1}, {"top_p": 0},
                                {"top_p": 1.5}, {"top_k": -2}, {"min_tokens": 5, "max_tokens": 2}])
def test_invalid_sampling_params_are_named(kw):
    with pytest.raises(InvalidSamplingParams, match=next(iter(kw)).split("_")[0]):
        SamplingParams(**kw)
