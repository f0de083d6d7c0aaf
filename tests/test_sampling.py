"""The sampler against exact distributions, and SamplingParams validation."""

from __future__ import annotations

import pytest
import torch

from shoal.sampling_params import InvalidSamplingParams, SamplingParams
from worker import cpu_ops
from worker.sampler import (
    Sampler,
    _candidates,
    _inverse_transform,
    _sample_top_k_top_p,
    adjust_logits,
)

# The torch path, and the C++ kernels (`shoal::sample_rows`, `log_normalizers`, `topk_rows`)
# where they built.
KERNELS = [False, pytest.param(True, marks=pytest.mark.skipif(
    not cpu_ops.load(), reason="the C++ kernels did not build here"))]


def _draw(logits, params, n, seed=0, kernels=False):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(logits.shape[-1])
    for _ in range(n):
        tok, _, _ = Sampler(kernels)(logits.clone(), [params], [gen])
        counts[tok[0]] += 1
    return counts / n


@pytest.mark.parametrize("kernels", KERNELS)
def test_temperature_sampling_follows_softmax(kernels):
    logits = torch.randn(1, 12) * 2
    logits[0, 3] = float("-inf")  # a masked token (structured outputs, allowed_token_ids)
    p = SamplingParams(temperature=0.7, seed=0)
    freq = _draw(logits, p, 4000, kernels=kernels)
    expected = torch.softmax(logits[0] / 0.7, -1)
    assert (freq - expected).abs().max() < 0.03 and freq[3] == 0


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize(("temperature", "min_p", "top_k"), [(1.0, 0.2, 0), (0.6, 0.3, 0),
                                                              (1.3, 0.1, 3)])
def test_min_p_keeps_the_tokens_near_the_most_likely(kernels, temperature, min_p, top_k):
    """Min-p against its definition: at the temperature, tokens less likely than min_p times
    the most likely one are never drawn, the rest in proportion (then top-k, in vLLM's order)."""
    logits = torch.randn(1, 12) * 1.5
    p = SamplingParams(temperature=temperature, min_p=min_p, top_k=top_k, seed=0)
    freq = _draw(logits, p, 4000, kernels=kernels)
    probs = torch.softmax(logits[0] / temperature, -1)
    kept = probs >= min_p * probs.max()
    if top_k:
        kept &= probs >= probs[kept].topk(min(top_k, int(kept.sum()))).values[-1]
    expected = torch.where(kept, probs, 0.0)
    expected /= expected.sum()
    assert (freq[~kept] == 0).all() and (freq - expected).abs().max() < 0.03


@pytest.mark.parametrize("kernels", KERNELS)
def test_top_k_and_top_p_cut_the_tail(kernels):
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]]))
    freq = _draw(logits, SamplingParams(temperature=1.0, top_k=2), 2000, kernels=kernels)
    assert freq[2:].sum() == 0 and abs(freq[0] - 0.4 / 0.7) < 0.05
    freq = _draw(logits, SamplingParams(temperature=1.0, top_p=0.8), 2000, kernels=kernels)
    # 0.4 + 0.3 < 0.8, adding 0.15 reaches it: three tokens stay.
    assert freq[3:].sum() == 0 and freq[2] > 0


@pytest.mark.skipif(not cpu_ops.load(), reason="the C++ kernels did not build here")
@pytest.mark.parametrize(("vocab", "scale"), [(49152, 3.0), (100, 1.0), (70, 0.1), (2000, 12.0)])
def test_the_sampling_kernel_takes_the_token_torchs_inverse_transform_takes(vocab, scale):
    """`shoal::sample_rows` against softmax, cumsum and searchsorted on random rows with masked
    tokens: the same token but where the two sums round either side of a boundary (rare), and
    never a masked one."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(16, vocab, generator=gen) * scale
    logits[0, ::3] = float("-inf")
    logits[1, 1:] = float("-inf")  # one token left
    temps = torch.rand(16, generator=gen) + 0.3
    same = total = 0
    for _ in range(40):
        u = torch.rand(16, generator=gen)
        got = torch.ops.shoal.sample_rows(logits, temps, u)
        ref = _inverse_transform(torch.softmax(logits / temps[:, None], -1), u)
        assert torch.isfinite(logits.gather(1, got[:, None])).all() and got[1] == 0
        same += int((got == ref).sum())
        total += 16
    assert same >= 0.99 * total
    lse = torch.ops.shoal.log_normalizers(logits, temps)
    assert torch.allclose(lse, torch.logsumexp(logits / temps[:, None], -1), atol=1e-4)


def _reference_top_k_top_p(probs, p, u):
    """One row through a full sort: the top-k set, then the nucleus of its renormalized mass."""
    values, order = probs.sort(descending=True)
    vocab = len(values)
    k = p.top_k if p.top_k > 0 else vocab
    values = values.masked_fill(torch.arange(vocab) >= k, 0.0)
    mass = values.sum() if k < vocab else 1.0
    keep = values.masked_fill((values.cumsum(0) - values) / mass >= p.top_p, 0.0)
    cdf = keep.cumsum(0)
    return int(order[int(torch.searchsorted(cdf, max(float(u) * float(cdf[-1]), 1e-38)))])


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("scale", [0.05, 1.0, 4.0])  # flat (nuclei need widening) to peaked
@pytest.mark.parametrize("params", [
    [SamplingParams(top_p=0.9), SamplingParams(top_k=40), SamplingParams(top_k=200, top_p=0.5),
     SamplingParams(top_p=0.3)],
    [SamplingParams(top_k=5000, top_p=0.99), SamplingParams(top_k=1), SamplingParams(top_p=0.6)],
])
def test_top_k_top_p_sets_match_a_full_sort(scale, params, kernels):
    """The torch path takes the full sort's token (by probability: tokens of equal probability
    may come in either order from topk and sort); the kernels' candidates, whose probabilities
    round differently, take it but at rare boundaries, and always a token of the sets."""
    vocab = 3000
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(params), vocab, generator=gen) * scale
    probs = torch.softmax(logits, dim=-1)
    temps = torch.ones(len(params))
    same = 0
    for trial in range(50):
        u = torch.rand(len(params), generator=gen)
        got = _sample_top_k_top_p(_candidates(logits, temps, kernels), vocab, params, u).tolist()
        ref = [_reference_top_k_top_p(probs[r], params[r], u[r]) for r in range(len(params))]
        if not kernels:
            assert [float(probs[r, t]) for r, t in enumerate(got)] == \
                [float(probs[r, t]) for r, t in enumerate(ref)]
        same += sum(float(probs[r, t]) == float(probs[r, x])
                    for r, (t, x) in enumerate(zip(got, ref)))
        for r, t in enumerate(got):  # within the row's sets: no more likely than u = 1 allows
            last = _reference_top_k_top_p(probs[r], params[r], torch.tensor(1.0 - 2**-24))
            assert probs[r, t] >= probs[r, last]
    assert same >= 0.98 * 50 * len(params)


def test_inverse_transform_never_picks_a_zero_weight():
    weights = torch.tensor([[0.0, 0.0, 0.25, 0.5, 0.25, 0.0]] * 3)
    u = torch.tensor([0.0, 1.0 - 2.0**-24, 0.5])
    assert _inverse_transform(weights, u).tolist() == [2, 4, 3]


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("top_k", [0, 5])
def test_a_top_p_too_small_for_float32_keeps_the_most_likely_token(kernels, top_k):
    """The API takes any top_p > 0; one below float32's smallest positive value rounds to 0,
    which once dropped every candidate, and the worker died on the index past the last (found
    by schemathesis through /v1/responses). The nucleus always holds the most likely token."""
    logits = torch.randn(4, 500, generator=torch.Generator().manual_seed(1)) * 3
    params = SamplingParams(temperature=1.0, top_p=5e-324, top_k=top_k, seed=0)
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    tokens, _, _ = Sampler(kernels)(logits.clone(), [params] * 4, gens)
    assert list(tokens) == logits.argmax(-1).tolist()


def test_inverse_transform_keeps_a_row_without_weight_in_range():
    weights = torch.tensor([[float("nan")] * 4, [0.0] * 4])
    assert _inverse_transform(weights, torch.tensor([0.5, 0.5])).tolist() == [3, 3]


def test_greedy_rows_and_logprobs():
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0.0, logprobs=True), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0.0)]
    gens = [None, torch.Generator().manual_seed(1), None]
    tokens, logprobs, _ = Sampler()(logits.clone(), params, gens)
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())
    assert logprobs[0] == pytest.approx(float(torch.log_softmax(logits[0], -1).max()), abs=1e-5)
    assert logprobs[1] is None and logprobs[2] is None


@pytest.mark.parametrize("kernels", KERNELS)
def test_a_temperature_too_small_to_divide_by_is_greedy(kernels):
    """Below SAMPLING_EPS a temperature is greedy (vLLM's rule): 1e-50 is 0 in float32, and the
    sampling kernels refused it, which ended the worker that ran the request."""
    logits = torch.randn(2, 50)
    params = [SamplingParams(temperature=t, seed=3) for t in (1e-50, 5e-6)]
    gens = [torch.Generator().manual_seed(3) for _ in params]
    tokens, _, _ = Sampler(kernels)(logits.clone(), params, gens)
    assert tokens == logits.argmax(-1).tolist()


def test_top_logprobs_are_each_rows_most_likely_tokens_of_the_raw_distribution():
    logits = torch.randn(4, 300) * 3
    params = [SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5),
              SamplingParams(temperature=0.9, seed=2, logprobs=True, top_logprobs=2,
                             presence_penalty=1.5),
              SamplingParams(temperature=0.0, logprobs=True),
              SamplingParams(temperature=0.0)]
    gens = [None, torch.Generator().manual_seed(2), None, None]
    hist = [((), 0), ([int(logits[1].argmax())], 0), ((), 0), ((), 0)]
    tokens, logprobs, tops = Sampler()(logits.clone(), params, gens, None, hist)
    for row, k in ((0, 5), (1, 2)):
        oracle = torch.log_softmax(logits[row].double(), -1)  # unpenalized, unscaled
        ids = oracle.argsort(descending=True)[:k].tolist()
        assert [t for t, _ in tops[row]] == ids
        assert [lp for _, lp in tops[row]] == pytest.approx(oracle[ids].tolist(), abs=1e-5)
        assert logprobs[row] == pytest.approx(float(oracle[tokens[row]]), abs=1e-5)
    assert tops[2] is None and tops[3] is None and logprobs[3] is None
    with pytest.raises(InvalidSamplingParams, match="needs logprobs"):
        SamplingParams(top_logprobs=3)
    with pytest.raises(InvalidSamplingParams, match="top_logprobs"):
        SamplingParams(logprobs=True, top_logprobs=21)


def test_same_seed_same_tokens_regardless_of_neighbours():
    logits = torch.randn(4, 100)
    p = SamplingParams(temperature=1.0, seed=5)
    alone, _, _ = Sampler()(logits[:1].clone(), [p], [torch.Generator().manual_seed(5)])
    others = [SamplingParams(temperature=1.3, top_p=0.5, seed=i) for i in range(3)]
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    mixed, _, _ = Sampler()(torch.cat([logits[1:3], logits[:1], logits[3:]]).clone(),
                         [others[0], others[1], p, others[2]],
                         [gens[0], gens[1], torch.Generator().manual_seed(5), gens[2]])
    assert mixed[2] == alone[0]


def _histories(rows, vocab, seed):
    """Random (token ids, prompt length) per row, with repeats in prompt and output."""
    rng = torch.Generator().manual_seed(seed)
    out = []
    for r in range(rows):
        n_prompt, n_out = 3 + 2 * r, 5 + 3 * r
        ids = torch.randint(0, vocab // 3, (n_prompt + n_out,), generator=rng).tolist()
        out.append((ids, n_prompt))
    return out


def test_penalties_match_a_per_token_reference():
    vocab = 40
    logits = torch.randn(4, vocab) * 3
    params = [SamplingParams(repetition_penalty=1.7, logit_bias=((3, 2.5), (39, -100))),
              SamplingParams(presence_penalty=0.8),
              SamplingParams(frequency_penalty=-0.6, repetition_penalty=0.5, logit_bias=((0, 7),)),
              SamplingParams(presence_penalty=-1.5, frequency_penalty=1.1, repetition_penalty=1.2)]
    hist = _histories(4, vocab, 0)
    got = adjust_logits(logits, params, hist)
    for r, (p, (ids, n)) in enumerate(zip(params, hist)):
        bias = dict(p.logit_bias)
        for t in range(vocab):
            x = float(logits[r, t]) + bias.get(t, 0.0)
            c = ids[n:].count(t)
            if t in ids:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            x -= p.frequency_penalty * c + (p.presence_penalty if c else 0.0)
            assert float(got[r, t]) == pytest.approx(x, rel=1e-6, abs=1e-6), (r, t)
    assert not torch.equal(got, logits)


def test_repetition_penalty_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    vocab = 50
    logits = torch.randn(3, vocab) * 4
    for r, (ids, n) in enumerate(_histories(3, vocab, 1)):
        ours = adjust_logits(logits[r:r + 1], [SamplingParams(repetition_penalty=1.4)], [(ids, n)])
        theirs = RepetitionPenaltyLogitsProcessor(1.4)(torch.tensor([ids]), logits[r:r + 1].clone())
        torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("kernels", KERNELS)
def test_a_repetition_penalty_near_zero_samples_a_seen_token(kernels):
    """repetition_penalty 1e-40 (any positive one is taken) favors the tokens seen above all:
    their positive logits, divided by it, pass float32's range and are capped, so a sampled row
    still draws one of them, never an arbitrary token from a NaN distribution."""
    logits = torch.randn(3, 64)
    logits[:, 10:13] = torch.tensor([0.5, 1.0, 2.0])  # the seen tokens' logits: positive
    hist = [([10, 11, 12, 11], 2)] * 3
    params = [SamplingParams(repetition_penalty=1e-40, temperature=t, seed=s, top_p=p)
              for t, s, p in ((1.0, 1, 1.0), (0.05, 2, 1.0), (0.7, 3, 0.9))]
    adjusted = adjust_logits(logits, params, hist)
    assert torch.isfinite(adjusted).all()
    gens = [torch.Generator().manual_seed(p.seed) for p in params]
    tokens, _, _ = Sampler(kernels)(logits, params, gens, None, hist)
    assert all(t in (10, 11, 12) for t in tokens), tokens


def test_logit_bias_survives_the_wire_and_bans_a_token():
    p = SamplingParams(temperature=0.0, logit_bias=((4, -100.0), (9, 3.0)))
    assert SamplingParams.from_dict(p.to_dict()) == p
    logits = torch.zeros(1, 10)
    logits[0, 4] = 50.0  # the argmax, until banned
    tokens, _, _ = Sampler()(logits, [p], [None], logits.argmax(-1), [([1, 2], 2)])
    assert tokens == [9]


def test_penalized_greedy_rows_pick_from_penalized_logits_and_report_raw_logprobs():
    logits = torch.randn(2, 30)
    top = int(logits[0].argmax())
    hist = [([top, top, 3], 1), ([top], 1)]
    params = [SamplingParams(temperature=0.0, frequency_penalty=2.0, logprobs=True),
              SamplingParams(temperature=0.0)]
    tokens, logprobs, _ = Sampler()(logits.clone(), params, [None, None], logits.argmax(-1),
                                    hist)
    expected = adjust_logits(logits[:1], params[:1], hist[:1])[0].argmax()
    assert tokens[0] == int(expected) != top  # twice in the output: 4 below its old value
    assert tokens[1] == int(logits[1].argmax())  # no penalty: the given argmax stands
    assert logprobs[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[tokens[0]]), abs=1e-5)
    with pytest.raises(ValueError, match="history"):
        Sampler()(logits.clone(), params, [None, None], None)


@pytest.mark.parametrize("kw", [{"max_tokens": 0}, {"temperature": -1},
                                {"temperature": float("nan")}, {"min_p": 1.5}, {"top_p": 0},
                                {"top_p": 1.5}, {"top_k": -2}, {"min_tokens": 5, "max_tokens": 2},
                                {"presence_penalty": 2.5}, {"frequency_penalty": -2.1},
                                {"repetition_penalty": 0.0}, {"repetition_penalty": float("inf")},
                                {"presence_penalty": float("nan")},
                                {"logit_bias": ((5, 101.0),)}, {"logit_bias": ((5, 1.0), (5, 2.0))}])
def test_invalid_sampling_params_are_named(kw):
    with pytest.raises(InvalidSamplingParams, match=next(iter(kw)).split("_")[0]):
        SamplingParams(**kw)


def test_bad_word_bans_equal_a_brute_force_check():
    """The engine's bans for bad words (words indexed by the token before their last) against
    their definition, on random words and outputs over a small vocabulary: a one-token word
    always; a longer one where the output ends with all but its last token (a prefix reaching
    into the prompt does not count, as in vLLM)."""
    import random

    from worker.engine import _bad_word_ends, _bad_word_index

    rng = random.Random(0)
    hits = 0
    for _ in range(3000):
        words = [tuple(rng.randrange(5) for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 5))]
        prompt = [rng.randrange(5) for _ in range(rng.randint(1, 6))]
        output = [rng.randrange(5) for _ in range(rng.randint(0, 6))]
        want = sorted(w[-1] for w in words if len(w) == 1 or (
            len(w) - 1 <= len(output) and output[len(output) - len(w) + 1:] == list(w[:-1])))
        got = sorted(_bad_word_ends(_bad_word_index(tuple(words)), prompt + output, len(output)))
        assert got == want, (words, prompt, output)
        hits += any(len(w) > 1 for w in words) and bool(want)
    assert hits > 300  # longer words matched, not only one-token ones
