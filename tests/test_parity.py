"""The engine against Hugging Face transformers on the real SmolLM2 model, float32, greedy."""

from __future__ import annotations

import torch

from shoal.messages import IterationPlan, NewRequest
from shoal.sampling_params import SamplingParams
from tests.conftest import make_engine

TEXTS = [
    "Hi",
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "List three prime numbers and explain why each is prime.",
    "Ünïcödé and emoji 🐟🐠 test: ",
]


def _prompts(tokenizer) -> list[list[int]]:
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, tokenize=True, return_dict=True)
    prompts.append(list(chat["input_ids"]))
    story = " ".join(f"Sentence number {i} tells of the fleet and its queue." for i in range(30))
    long_prompt = tokenizer.encode(story, add_special_tokens=False)
    assert len(long_prompt) > 300
    prompts.append(long_prompt)
    return prompts


def test_greedy_tokens_and_logits_match_transformers(fp32_model, hf_model, tokenizer):
    prompts = _prompts(tokenizer)
    assert len(prompts) >= 8
    new_tokens = 32
    engine = make_engine(fp32_model, keep_logits=True)
    ours: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    our_logits: dict[str, list[torch.Tensor]] = {r: [] for r in ours}
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0)
    pending = list(enumerate(prompts))
    it = 0
    # One request joins every other iteration, so requests join mid-flight and finish apart.
    while pending or engine.running:
        admit = []
        if pending and it % 2 == 0:
            i, p = pending.pop(0)
            admit.append(NewRequest(f"r{i}", p, params))
        result = engine.step(IterationPlan(iteration=it, admit=admit))
        for out in result.outputs:
            assert out.error is None
            ours[out.request_id].append(out.token_id)
            our_logits[out.request_id].append(engine.last_logits[out.request_id])
        it += 1
    assert engine.num_free_blocks == engine.num_total_blocks
    # Most prompts must run the full 32 tokens, or the comparison says little.
    assert sum(len(t) == new_tokens for t in ours.values()) >= len(prompts) // 2

    eos = hf_model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    for i, p in enumerate(prompts):
        mine = ours[f"r{i}"]
        assert len(mine) == new_tokens or mine[-1] in eos
        # One causal forward over the prompt and our tokens gives transformers' logits after
        # each prefix (256 decode steps of its own `generate` took 15 s of this test): its greedy
        # answer is ours exactly when each of our tokens is its argmax there.
        with torch.inference_mode():
            theirs = hf_model(torch.tensor([p + mine])).logits[0, len(p) - 1:-1].float()
        assert theirs.argmax(dim=1).tolist() == mine, f"prompt {i} ({len(p)} tokens) diverged"
        for step in sorted({0, 1, len(mine) // 2, len(mine) - 1} & set(range(len(mine)))):
            a = our_logits[f"r{i}"][step]
            b = theirs[step]
            rel = ((a - b).norm() / b.norm()).item()
            assert rel <= 1e-3, f"prompt {i} step {step}: relative logits error {rel:.2e}"


def test_penalized_greedy_tokens_match_transformers(fp32_model, hf_model, tokenizer):
    """Repetition penalty against transformers' own; presence and frequency penalties (which
    transformers lacks) against a logits processor written to OpenAI's definition."""
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    class OpenAIPenalties:
        def __init__(self, prompt_len: int, presence: float, frequency: float):
            self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

        def __call__(self, input_ids, scores):
            for t in set(input_ids[0, self.prompt_len:].tolist()):
                c = int((input_ids[0, self.prompt_len:] == t).sum())
                scores[0, t] -= self.frequency * c + self.presence
            return scores

    prompt = tokenizer.encode("one two three one two three one two three", add_special_tokens=False)
    engine = make_engine(fp32_model)
    new_tokens = 32
    plain = _greedy(engine, prompt, new_tokens, {})
    cases = [({"repetition_penalty": 1.3}, [RepetitionPenaltyLogitsProcessor(1.3)]),
             ({"presence_penalty": 1.0, "frequency_penalty": 0.5},
              [OpenAIPenalties(len(prompt), 1.0, 0.5)])]
    for kw, processors in cases:
        ours = _greedy(engine, prompt, new_tokens, kw)
        with torch.inference_mode():
            g = hf_model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                                  logits_processor=LogitsProcessorList(processors))
        assert ours == g[0, len(prompt):].tolist(), kw
        assert ours != plain, kw  # the penalty changed what greedy picks


def test_bad_words_match_transformers(fp32_model, hf_model, tokenizer):
    """vLLM's `bad_words` as token sequences: a one-token word is never sampled, and a
    two-token word's second token not right after its first; greedy tokens against
    transformers' `bad_words_ids` (which bans the same way), on words taken from the
    unconstrained reply so that the ban changes it."""
    prompt = tokenizer.encode("The capital of France is Paris. The capital of Italy is",
                              add_special_tokens=False)
    engine = make_engine(fp32_model)
    plain = _greedy(engine, prompt, 24, {})
    one = (plain[1],)
    two = next((plain[k], plain[k + 1]) for k in range(2, len(plain) - 1)
               if plain[k] != prompt[-1] and plain[k + 1] not in plain[:k + 1])
    for words in ([one], [two], [one, two]):
        ours = _greedy(engine, prompt, 24, {"bad_words_token_ids": tuple(words)})
        with torch.inference_mode():
            g = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                  bad_words_ids=[list(w) for w in words])
        assert ours == g[0, len(prompt):].tolist(), words
        assert ours != plain, words
        if one in words:
            assert one[0] not in ours
        if two in words:
            assert all(tuple(ours[k:k + 2]) != two for k in range(len(ours) - 1))


def _greedy(engine, prompt: list[int], max_tokens: int, kw: dict) -> list[int]:
    from worker.offline import generate

    req = NewRequest("p", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw))
    return generate(engine, [req])["p"].token_ids


def test_prompt_logprobs_match_transformers_across_chunks_and_the_prefix_cache(
        fp32_model, hf_model, tokenizer):
    """Each prompt token's logprob given the ones before it, and each position's most likely
    tokens, as transformers computes them, with the prompt prefilled in chunks beside a request
    that does not ask; a second request with the same prompt computes it again (no cache hit)."""
    from worker.offline import stream

    ids = _prompts(tokenizer)[-1][:150]
    with torch.no_grad():
        oracle = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), -1)
    expected = oracle[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    top_values, top_ids = oracle[:-1].topk(3, dim=-1)
    engine = make_engine(fp32_model, max_num_batched_tokens=64)
    scoring = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    for run in range(2):
        got: dict[int, tuple[float, list]] = {}
        outs = list(stream(engine, [NewRequest(f"s{run}", ids, scoring),
                                    NewRequest(f"x{run}", ids[:40], SamplingParams(max_tokens=2))]))
        for out in outs:
            if out.prompt_logprobs is not None:
                assert out.request_id == f"s{run}" and out.token_id is None
                for j, lp in enumerate(out.prompt_logprobs):
                    got[out.prompt_position + j] = (lp, out.prompt_top_logprobs[j])
        assert sum(o.prompt_logprobs is not None for o in outs) == 3  # 150 tokens, 64 a chunk
        assert sorted(got) == list(range(1, len(ids)))
        lps = torch.tensor([got[p][0] for p in range(1, len(ids))], dtype=torch.float64)
        assert torch.allclose(lps, expected, atol=2e-3), (lps - expected).abs().max()
        for p in range(1, len(ids)):
            pairs = got[p][1]
            assert [t for t, _ in pairs] == top_ids[p - 1].tolist() or \
                torch.allclose(torch.tensor([v for _, v in pairs], dtype=torch.float64),
                               top_values[p - 1], atol=2e-3)  # a near tie may swap
            assert [v for _, v in pairs] == sorted((v for _, v in pairs), reverse=True)
