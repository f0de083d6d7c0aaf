"""Batch invariance and chunked prefill on the real model (float32)."""

from __future__ import annotations

import random

import torch

from shoal.messages import IterationPlan, NewRequest
from shoal.sampling_params import SamplingParams
from tests.conftest import make_engine, random_weights, tiny_config
from worker.attention import build_metadata
from worker.config import EngineConfig
from worker.engine import Engine
from worker.offline import generate


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def test_seeded_request_is_batch_invariant(fp32_model):
    rng = random.Random(1)
    prompt = _prompt(rng, 40)
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234,
                            ignore_eos=True)
    engine = make_engine(fp32_model)
    alone = generate(engine, [NewRequest("target", prompt, params)])["target"].token_ids
    assert len(alone) == 24

    # The same request among 15 others that join at different iterations, have other prompts,
    # seeds and lengths, and leave before and after it.
    others = [NewRequest(f"o{i}", _prompt(rng, rng.randint(5, 120)),
                         SamplingParams(max_tokens=rng.randint(1, 40), temperature=1.0, seed=i,
                                        ignore_eos=True))
              for i in range(15)]
    tokens: list[int] = []
    pending = others[:]
    schedule = [[pending.pop(0), pending.pop(0)], [NewRequest("target", prompt, params), pending.pop(0)]]
    it = 0
    while engine.running or pending or schedule:
        if schedule:
            admit = schedule.pop(0)
        else:
            admit = [pending.pop(0)] if pending and it % 2 == 0 else []
        for out in engine.step(IterationPlan(admit=admit)).outputs:
            if out.request_id == "target":
                tokens.append(out.token_id)
        it += 1
    assert tokens == alone
    # And a different seed gives different tokens (the seed is really used).
    other_seed = SamplingParams(**{**params.to_dict(), "seed": 99})
    assert generate(engine, [NewRequest("x", prompt, other_seed)])["x"].token_ids != alone


def test_seeded_request_resumed_with_its_output_goes_on_as_if_never_moved(fp32_model):
    """A preempted or migrated request comes back with its output so far: its generator skips
    the draws those tokens took, so its next tokens are the ones it would have sampled."""
    prompt = _prompt(random.Random(3), 30)
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)
    engine = make_engine(fp32_model)
    whole = generate(engine, [NewRequest("a", prompt, params)])["a"].token_ids
    resumed = generate(engine, [NewRequest("b", prompt, params, output_token_ids=whole[:8])])
    assert whole[:8] + resumed["b"].token_ids == whole
    # Without the skip the stream would restart: the first resumed token is drawn with u of
    # token 0, which (for this seed) picks another token.
    fresh = generate(engine, [NewRequest("c", prompt + whole[:8], params)])["c"].token_ids
    assert fresh != resumed["b"].token_ids


def test_seeded_request_alone_vs_batch_full_stream(fp32_model):
    """Every token, the first included, is identical alone and in a crowd."""
    rng = random.Random(2)
    prompt = _prompt(rng, 30)
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    engine = make_engine(fp32_model)
    alone = generate(engine, [NewRequest("t", prompt, params)])["t"].token_ids
    crowd = [NewRequest(f"c{i}", _prompt(rng, rng.randint(3, 90)),
                        SamplingParams(max_tokens=rng.randint(1, 20), temperature=1.0, ignore_eos=True))
             for i in range(15)]
    together = generate(engine, crowd[:7] + [NewRequest("t", prompt, params)] + crowd[7:])
    assert together["t"].token_ids == alone


def test_chunked_prefill_gives_the_same_tokens(fp32_model):
    rng = random.Random(3)
    prompts = [_prompt(rng, n) for n in (150, 37, 301)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    reqs = [NewRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]
    whole = generate(make_engine(fp32_model, max_num_batched_tokens=4096), reqs)
    engine = make_engine(fp32_model, max_num_batched_tokens=32, keep_logits=True)
    # With a budget of 32 tokens the 301-token prompt needs at least 10 iterations.
    first = engine.step(IterationPlan(admit=[reqs[2]]))
    assert first.num_prefill_tokens == 32 and not first.outputs
    assert first.num_pending_prefill_tokens == 301 - 32  # what the scheduler estimates from
    second = engine.step(IterationPlan(admit=[reqs[1]]))
    assert second.num_pending_prefill_tokens == 301 + 37 - 64
    engine.release("r1")
    engine.release("r2")
    chunked = generate(engine, reqs)
    for r in reqs:
        assert chunked[r.request_id].token_ids == whole[r.request_id].token_ids


def test_decodes_are_not_stalled_by_a_long_prefill(fp32_model):
    """A running decode samples in every iteration while a long prompt is prefilled in chunks."""
    rng = random.Random(4)
    engine = make_engine(fp32_model, max_num_batched_tokens=24)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine.step(IterationPlan(admit=[NewRequest("short", _prompt(rng, 8), params)]))
    engine.step(IterationPlan(admit=[NewRequest("long", _prompt(rng, 200), params)]))
    for _ in range(6):
        res = engine.step()
        ids = [o.request_id for o in res.outputs]
        assert "short" in ids
        assert res.num_decode_tokens == 1 and res.num_prefill_tokens == 23


def test_the_last_layer_runs_only_the_rows_asked_for():
    """`LlamaModel.forward(..., output_rows)` gives exactly those rows of the full forward (the
    last layer's O and MLP run on them alone), writes the same K/V, and none when none is asked."""
    cfg = tiny_config(num_layers=3)
    engine = Engine(cfg, random_weights(cfg, seed=3), EngineConfig(dtype=torch.float32, block_size=4,
                                                                   kv_cache_bytes=1 << 20))
    g = torch.Generator().manual_seed(4)
    lens = [11, 6]
    tables = [list(range(0, 3)), list(range(3, 5))]
    meta = build_metadata([], [], [(t, 0, n) for t, n in zip(tables, lens)], 4)
    ids = torch.randint(2, cfg.vocab_size, (sum(lens),), generator=g)
    positions = torch.cat([torch.arange(n) for n in lens])
    model, kv = engine.model, engine.kv_cache
    full = model.forward(ids, positions, meta, kv).clone()
    k_full = [k.clone() for k in kv.k]
    rows = torch.tensor([10, 16, 3])
    some = model.forward(ids, positions, meta, kv, rows)
    assert some.shape == (3, cfg.hidden_size)
    assert torch.allclose(some, full[rows], atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(k_full, kv.k))
    assert model.forward(ids, positions, meta, kv, rows[:0]).shape == (0, cfg.hidden_size)
