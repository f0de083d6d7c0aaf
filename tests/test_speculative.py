"""Speculative decoding by prompt lookup: the proposer against a brute-force search, its
configuration, and the real model's tokens with drafts against plain decoding."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from shoal.messages import IterationPlan, NewRequest
from shoal.sampling_params import SamplingParams
from tests.conftest import make_engine, tiny_config, tiny_engine
from worker.config import SpeculativeConfig
from worker.engine import Engine
from worker.offline import generate, stream
from worker.speculative import propose_ngram

# -- the proposer -------------------------------------------------------------------------------


def _brute_force(ids: list[int], k: int, lo: int, hi: int) -> list[int]:
    for n in range(min(hi, len(ids) - 1), lo - 1, -1):
        suffix = ids[len(ids) - n:]
        for start in range(len(ids) - n - 1, -1, -1):  # the most recent earlier occurrence
            if ids[start:start + n] == suffix:
                return ids[start + n: start + n + k]
    return []


def test_proposals_equal_a_brute_force_search():
    rng = random.Random(0)
    found = 0
    for _ in range(2000):
        ids = [rng.randrange(4) for _ in range(rng.randrange(0, 40))]
        k, lo = rng.randrange(0, 6), rng.randrange(1, 4)
        hi = lo + rng.randrange(0, 4)
        got = propose_ngram(ids, k, lo, hi)
        assert got == _brute_force(ids, k, lo, hi), (ids, k, lo, hi)
        found += bool(got)
    assert found > 500  # the cases exercised matches, not only misses


def test_the_longest_suffix_and_its_latest_occurrence_win():
    # "1 2 3" occurred twice (followed by 7, then by 8); "3" alone was last followed by 9.
    ids = [1, 2, 3, 7, 5, 1, 2, 3, 8, 6, 3, 9, 4, 1, 2, 3]
    assert propose_ngram(ids, 2, 1, 3) == [8, 6]
    assert propose_ngram(ids, 2, 1, 1) == [9, 4]
    assert propose_ngram(ids, 5, 4, 4) == []  # "4 1 2 3" never occurred before
    assert propose_ngram([5, 6, 5, 6], 5, 2, 2) == [5, 6]  # cut at the end of the context


# -- configuration -----------------------------------------------------------------------------


def test_speculative_config_parses_vllms_json_and_refuses_bad_values():
    c = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 5, '
                                    '"prompt_lookup_max": 3}')
    assert (c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == (5, 3, 2)
    assert SpeculativeConfig.from_json('{"prompt_lookup_max": 1}').prompt_lookup_min == 1
    for bad, words in [("{", "not JSON"), ("[1]", "JSON object"), ('{"method": "eagle"}', "ngram"),
                       ('{"num_speculative_tokens": 0}', "positive"),
                       ('{"num_speculative_tokens": "4"}', "must be int"),
                       ('{"num_speculative_tokens": true}', "must be int"),
                       ('{"prompt_lookup_min": 3, "prompt_lookup_max": 2}', "at least"),
                       ('{"draft_model": "x"}', "unknown key")]:
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.from_json(bad)


# -- the engine --------------------------------------------------------------------------------

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)


def _repetitive_prompt(tokenizer) -> list[int]:
    """A prompt whose answer copies much of it: drafts get kept and rejected both."""
    text = ("Repeat this list exactly, then repeat it again: apples, pears, plums, cherries, "
            "apples, pears, plums, cherries, grapes, lemons.")
    chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(chat, add_special_tokens=False)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=1),
    SamplingParams(max_tokens=48, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.05, frequency_penalty=0.05, min_tokens=30),
], ids=["greedy", "seeded", "penalty-min-tokens"])
def test_drafted_tokens_equal_plain_decoding(fp32_model, tokenizer, params):
    prompt = _repetitive_prompt(tokenizer)
    plain = make_engine(fp32_model)
    spec = make_engine(fp32_model, speculative=SPEC)
    want = generate(plain, [NewRequest("r", prompt, params)])["r"]
    got = generate(spec, [NewRequest("r", prompt, params)])["r"]
    assert got.token_ids == want.token_ids
    assert got.finish_reason == want.finish_reason
    if params.logprobs:
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-3)
    # Drafts were checked, some kept (fewer passes than tokens) and some rejected.
    assert 0 < spec.spec_accepted_tokens < spec.spec_draft_tokens
    assert spec.num_free_blocks == spec.num_total_blocks


def test_drafts_complete_no_bad_word(fp32_model, tokenizer):
    """A bad word whose first token a kept draft supplies still has its last one banned in the
    same pass: the tokens equal plain decoding's with the same bad words, and hold no bad word."""
    prompt = _repetitive_prompt(tokenizer)
    base = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    free = generate(make_engine(fp32_model), [NewRequest("r", prompt, base)])["r"].token_ids
    # A pair the reply repeats (a copy, which prompt lookup drafts), not at its start.
    word = next((a, b) for k, (a, b) in enumerate(zip(free[4:], free[5:]), 4)
                if (a, b) in zip(free[:k], free[1:k]))
    params = replace(base, bad_words_token_ids=(word,))
    spec = make_engine(fp32_model, speculative=SPEC)
    want = generate(make_engine(fp32_model), [NewRequest("r", prompt, params)])["r"].token_ids
    got = generate(spec, [NewRequest("r", prompt, params)])["r"].token_ids
    assert got == want != free
    assert word not in set(zip(got, got[1:]))
    assert spec.spec_accepted_tokens > 0


def test_a_pass_yields_the_drafts_kept_plus_one_and_frees_the_rejected_blocks(fp32_model, tokenizer):
    prompt = _repetitive_prompt(tokenizer)
    spec = make_engine(fp32_model, speculative=SPEC, block_size=4)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    spec.step(IterationPlan(admit=[NewRequest("r", prompt, params)]))
    produced = 1
    while "r" in spec.running:
        s = spec.running["r"]
        drafts, kept_before = spec.spec_draft_tokens, spec.spec_accepted_tokens
        out = spec.step().outputs
        kept = spec.spec_accepted_tokens - kept_before
        assert len(out) == kept + 1 or out[-1].finish_reason == "length"
        assert [o.index for o in out] == list(range(produced, produced + len(out)))
        produced += len(out)
        if "r" in spec.running:
            assert spec.spec_draft_tokens - drafts <= SPEC.num_speculative_tokens
            assert s.num_uncomputed_tokens == 1
            assert len(s.block_table) == spec.blocks_for_tokens(s.num_computed_tokens)
    assert produced == 64  # never past max_tokens
    assert spec.num_free_blocks == spec.num_total_blocks


def test_prefix_cache_blocks_filled_while_drafting_hold_the_kept_tokens(fp32_model, tokenizer):
    """Blocks registered after drafting passes hold only kept tokens: a request sent again with
    the output as its prompt hits them and continues as a plain engine does."""
    prompt = _repetitive_prompt(tokenizer)
    spec = make_engine(fp32_model, speculative=SPEC)
    plain = make_engine(fp32_model, enable_prefix_caching=False)
    first = generate(spec, [NewRequest("a", prompt, SamplingParams(max_tokens=48, temperature=0.0,
                                                                   ignore_eos=True))])["a"]
    longer = prompt + first.token_ids
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    hits = spec.prefix_cache_hits
    got = generate(spec, [NewRequest("b", longer, params)])["b"].token_ids
    assert spec.prefix_cache_hits - hits == (len(longer) - 1) // 16 * 16
    assert got == generate(plain, [NewRequest("b", longer, params)])["b"].token_ids


def _small_vocab_engine(num_blocks: int, spec: SpeculativeConfig = SPEC) -> Engine:
    """The tiny random model with 8 token ids: every token it samples occurred before, so a
    1-token suffix always proposes drafts. Blocks of 4 tokens."""
    return tiny_engine(num_blocks, 4, tiny_config(vocab_size=8), speculative=spec)


def test_no_drafts_in_iterations_of_many_decodes():
    engine = _small_vocab_engine(256, replace(SPEC, disable_by_batch_size=2))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    loop = [3, 4, 5, 6] * 4
    # Prompts of their own: sharing one, two would wait a step for its cached blocks, and
    # decodes would then start one at a time.
    many = [NewRequest(f"m{i}", loop[i:] + loop[:i], params) for i in range(3)]
    for _ in stream(engine, many):
        pass
    assert engine.spec_draft_tokens == 0
    for _ in stream(engine, many[:2]):
        pass
    assert engine.spec_draft_tokens > 0


def test_drafts_never_take_the_last_free_blocks():
    """Drafts that would need blocks no one has free are skipped (they never preempt): the
    request decodes through the last free block as without drafts."""
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    loop = [3, 4, 5, 6] * 4  # 16 tokens: 4 blocks of 4; the 5th (the last) for decoding

    def tokens_until(engine, computed: int) -> list[int]:
        tokens = [o.token_id for o in engine.step(IterationPlan(admit=[NewRequest("r", loop, params)])).outputs]
        while engine.running["r"].num_computed_tokens < computed:
            tokens += [o.token_id for o in engine.step().outputs]
        return tokens

    tight, roomy = _small_vocab_engine(5), _small_vocab_engine(64)
    # Positions 16-19 fill block 5: drafts running past it are dropped, earlier ones kept.
    got = tokens_until(tight, 20)
    assert got == tokens_until(roomy, 20)[: len(got)]
    assert tight.running["r"].num_computed_tokens == 20 and tight.num_free_blocks == 0
    assert roomy.running["r"].num_computed_tokens > 20  # its drafts ran into a sixth block
    assert 0 < tight.spec_draft_tokens
