"""Prefix caching: the allocator's shared and cached blocks, block hashes, and the real model's
tokens with prefixes taken from the cache against computing them."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.messages import IterationPlan, NewRequest
from shoal.prefix_hash import block_hashes
from shoal.sampling_params import InvalidSamplingParams, SamplingParams
from tests.conftest import make_engine, tiny_config, tiny_engine
from worker.kv_cache import BlockAllocator, KVCacheFullError, bytes_per_block
from worker.offline import generate

BS = 16


def _greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


# -- the allocator -----------------------------------------------------------------------------


def test_freed_registered_blocks_stay_cached_and_are_evicted_least_recent_first():
    a = BlockAllocator(4)
    first, second = a.allocate(2), a.allocate(2)
    for b, h in zip(first + second, (b"a", b"b", b"c", b"d")):
        a.register(b, h)
    a.free(first)
    assert a.num_free_blocks == 2 and a.num_cached_blocks == 4
    a.free(second)
    assert a.lookup([b"a", b"b", b"x"]) == first  # the longest run from the first hash
    assert a.lookup([b"b"]) == [first[1]]
    # Taking one back removes it from the eviction order; evictions then go oldest first.
    a.share([first[1]])
    assert a.num_free_blocks == 3 and a.ref_count(first[1]) == 1
    taken = a.allocate(2)
    assert taken == [first[0], second[0]]
    assert a.lookup([b"a"]) == [] and a.lookup([b"c"]) == []  # evicted, their hashes gone
    assert a.lookup([b"d"]) == [second[1]]
    with pytest.raises(KVCacheFullError):
        a.allocate(2)
    assert a.num_free_blocks == 1  # nothing was taken


def test_shared_block_is_free_only_after_its_last_owner_frees_it():
    a = BlockAllocator(2)
    (b,) = a.allocate(1)
    a.register(b, b"h")
    a.share(a.lookup([b"h"]))
    assert a.ref_count(b) == 2
    a.free([b])
    assert a.num_free_blocks == 1 and a.ref_count(b) == 1
    a.free([b])
    assert a.num_free_blocks == 2
    with pytest.raises(ValueError, match="freed twice"):
        a.free([b])


def test_a_hash_held_by_one_block_is_not_taken_over_by_another():
    a = BlockAllocator(3)
    x, y = a.allocate(2)
    a.register(x, b"h")
    a.register(y, b"h")  # computed twice at once: the first keeps the entry
    a.free([x, y])
    assert a.lookup([b"h"]) == [x]
    assert a.num_cached_blocks == 1 and a.num_free_blocks == 3


def test_reset_turns_cached_blocks_into_free_ones():
    a = BlockAllocator(3)
    blocks = a.allocate(3)
    for i, b in enumerate(blocks):
        a.register(b, bytes([i]))
    a.free(blocks[:2])
    a.reset_prefix_cache()
    assert a.num_cached_blocks == 0 and a.lookup([b"\x00"]) == []
    assert sorted(a.allocate(2)) == sorted(blocks[:2])
    a.free([blocks[2]])  # owned when the cache was reset: freed as a private block
    assert a.num_free_blocks == 1 and a.num_cached_blocks == 0


def test_block_hashes_name_prefixes_and_salts():
    rng = random.Random(0)
    tokens = [rng.randrange(50000) for _ in range(5 * BS + 3)]
    hashes = block_hashes(tokens, BS)
    assert len(hashes) == 5 and len(set(hashes)) == 5
    # A chain: extending from computed parents equals computing the whole, and each hash
    # depends on every token before its block's end, not on those after.
    assert block_hashes(tokens, BS, parents=hashes[:2]) == hashes
    assert block_hashes(tokens[: 3 * BS], BS) == hashes[:3]
    changed = list(tokens)
    changed[BS + 1] += 1
    other = block_hashes(changed, BS)
    assert other[0] == hashes[0] and all(o != h for o, h in zip(other[1:], hashes[1:]))
    # Salts separate every block; the same salt gives the same chain.
    salted = block_hashes(tokens, BS, salt="tenant-a")
    assert not set(salted) & set(hashes)
    assert block_hashes(tokens, BS, salt="tenant-a") == salted
    assert not set(block_hashes(tokens, BS, salt="tenant-b")) & set(salted)


def test_cache_salt_must_not_be_empty():
    with pytest.raises(InvalidSamplingParams, match="cache_salt"):
        SamplingParams(cache_salt="")
    assert SamplingParams.from_dict(SamplingParams(cache_salt="s").to_dict()).cache_salt == "s"


# -- block accounting under sharing (a tiny random model) --------------------------------------

CFG = tiny_config()
NUM_BLOCKS = 16
TINY_BS = 4


ops = st.lists(
    st.one_of(
        # admit: one of three stems, a suffix length, max_tokens
        st.tuples(st.just("admit"), st.integers(0, 2), st.integers(0, 9), st.integers(1, 8)),
        st.tuples(st.just("step"), st.just(0), st.just(0), st.just(0)),
        st.tuples(st.just("release"), st.integers(0, 20), st.just(0), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_shared_blocks_are_counted_once_and_never_written(sequence):
    engine = tiny_engine(NUM_BLOCKS, TINY_BS, max_num_batched_tokens=16)
    alloc = engine.kv_cache.allocator
    stems = [[(7 * s + j) % (CFG.vocab_size - 2) + 2 for j in range(10)] for s in range(3)]
    n = 0
    for op, a, b, c in sequence:
        if op == "admit":
            engine.add_request(NewRequest(f"r{n}", stems[a] + [2 + n] * b, _greedy(c)))
            n += 1
        elif op == "step":
            try:
                engine.step()
            except KVCacheFullError:
                engine.release(list(engine.running)[-1])
        else:
            ids = list(engine.running)
            if ids:
                engine.release(ids[a % len(ids)])
        owners: dict[int, int] = {}
        for s in engine.running.values():
            assert len(s.block_table) == -(-s.num_computed_tokens // TINY_BS)
            for j, blk in enumerate(s.block_table):
                owners[blk] = owners.get(blk, 0) + 1
        for s in engine.running.values():
            for j, blk in enumerate(s.block_table):
                if owners[blk] > 1:  # shared: a full block, below what the request computes next
                    assert (j + 1) * TINY_BS <= s.num_computed_tokens
        assert all(alloc.ref_count(blk) == k for blk, k in owners.items())
        assert len(owners) + engine.num_free_blocks == engine.num_total_blocks
    for rid in list(engine.running):
        engine.release(rid)
    assert engine.num_free_blocks == engine.num_total_blocks


# -- the real model ----------------------------------------------------------------------------


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def test_prefixes_from_the_cache_give_the_tokens_of_computing_them(fp32_model):
    rng = random.Random(3)
    system = _prompt(rng, 3 * BS + 5)
    reqs = [NewRequest(f"r{i}", system + _prompt(rng, rng.randint(1, 40)), _greedy(10))
            for i in range(4)]
    reqs.append(NewRequest("same", list(reqs[0].prompt_token_ids), _greedy(10)))
    reqs.append(NewRequest("sampled", list(reqs[1].prompt_token_ids),
                           SamplingParams(max_tokens=10, temperature=0.8, seed=7,
                                          ignore_eos=True, logprobs=True)))
    cold = make_engine(fp32_model, enable_prefix_caching=False)
    expected = generate(cold, reqs)
    assert cold.prefix_cache_hits == 0

    warm = make_engine(fp32_model)
    got = generate(warm, reqs)  # admitted together: the later ones wait an iteration, then hit
    assert {r: c.token_ids for r, c in got.items()} == {r: c.token_ids for r, c in expected.items()}
    assert got["sampled"].logprobs == pytest.approx(expected["sampled"].logprobs, abs=1e-3)
    assert warm.prefix_cache_hits >= 5 * 3 * BS
    # Sent again, after the first ones finished: everything but the last partial block hits.
    hits = warm.prefix_cache_hits
    again = generate(warm, [NewRequest("again", list(reqs[2].prompt_token_ids), _greedy(10))])
    n = len(reqs[2].prompt_token_ids)
    assert warm.prefix_cache_hits - hits == (n - 1) // BS * BS
    assert again["again"].token_ids == expected["r2"].token_ids
    assert warm.num_free_blocks == warm.num_total_blocks


def test_requests_share_blocks_while_they_run(fp32_model):
    rng = random.Random(4)
    prompt = _prompt(rng, 2 * BS + 3)
    engine = make_engine(fp32_model)
    start = engine.step(IterationPlan(admit=[NewRequest(f"c{i}", prompt, _greedy(8))
                                             for i in range(3)]))
    assert [(o.request_id, o.index, o.num_cached_tokens) for o in start.outputs] == [("c0", 0, 0)]
    first = engine.step()  # the other two take c0's blocks
    cached = {o.request_id: o.num_cached_tokens for o in first.outputs}
    assert cached == {"c0": 0, "c1": 2 * BS, "c2": 2 * BS}  # reported on each first token
    tables = [engine.running[f"c{i}"].block_table for i in range(3)]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert len({t[2] for t in tables}) == 3  # each its own last, partial block
    assert first.num_prefill_tokens == 2 * 3  # 3 tokens each of c1 and c2, none of 2 blocks
    assert engine.kv_cache.allocator.ref_count(tables[0][0]) == 3


def test_cache_salt_keeps_requests_apart(fp32_model):
    rng = random.Random(5)
    prompt = _prompt(rng, 3 * BS)
    engine = make_engine(fp32_model)
    generate(engine, [NewRequest("a", prompt, _greedy(2, cache_salt="tenant-a"))])
    for rid, salt in (("b", "tenant-b"), ("unsalted", None)):
        generate(engine, [NewRequest(rid, prompt, _greedy(2, cache_salt=salt))])
        assert engine.prefix_cache_hits == 0
    generate(engine, [NewRequest("a2", prompt, _greedy(2, cache_salt="tenant-a"))])
    assert engine.prefix_cache_hits == 2 * BS


def test_evicted_prefixes_are_computed_again(fp32_model):
    rng = random.Random(6)
    cfg, _ = fp32_model
    # Room for 12 blocks: a request of 3 blocks and its tokens, then others that evict it.
    engine = make_engine(fp32_model, kv_cache_bytes=12 * bytes_per_block(cfg, BS, torch.float32))
    first = _prompt(rng, 3 * BS + 1)
    reference = generate(engine, [NewRequest("first", first, _greedy(4))])["first"].token_ids
    for i in range(4):
        generate(engine, [NewRequest(f"o{i}", _prompt(rng, 3 * BS + 1), _greedy(4))])
    hits = engine.prefix_cache_hits
    again = generate(engine, [NewRequest("again", first, _greedy(4))])["again"].token_ids
    assert engine.prefix_cache_hits == hits  # evicted by the others
    assert again == reference


def test_requests_that_may_overflow_the_window_do_not_share(fp32_model):
    rng = random.Random(7)
    prompt = _prompt(rng, 2 * BS + 1)
    engine = make_engine(fp32_model, max_model_len=64)
    params = _greedy(40, context_overflow="shift", n_keep=4, n_discard=16)
    generate(engine, [NewRequest("a", prompt, params)])
    generate(engine, [NewRequest("b", prompt, params)])
    assert engine.prefix_cache_queries == 0 and engine.prefix_cache_hits == 0
    assert engine.kv_cache.allocator.num_cached_blocks == 0


def test_requests_sharing_little_do_not_wait_for_each_other(fp32_model):
    rng = random.Random(8)
    head = _prompt(rng, BS)
    a, b = head + _prompt(rng, 3 * BS), head + _prompt(rng, 3 * BS)  # one block of four shared
    engine = make_engine(fp32_model)
    first = engine.step(IterationPlan(admit=[NewRequest("a", a, _greedy(2)),
                                             NewRequest("b", b, _greedy(2))]))
    assert first.num_prefill_tokens == len(a) + len(b)
    assert sorted(o.request_id for o in first.outputs) == ["a", "b"]


def test_choices_of_a_prompt_longer_than_the_budget_follow_it_chunk_by_chunk(fp32_model):
    rng = random.Random(9)
    prompt = _prompt(rng, 9 * BS + 6)  # 150 tokens in chunks of at most 64
    reqs = [NewRequest(f"c{i}", prompt, _greedy(3)) for i in range(3)]
    cold = generate(make_engine(fp32_model, enable_prefix_caching=False,
                                max_num_batched_tokens=64), reqs)
    engine = make_engine(fp32_model, max_num_batched_tokens=64)
    prefilled, tokens = 0, {}
    result = engine.step(IterationPlan(admit=reqs))
    while True:
        prefilled += result.num_prefill_tokens
        for o in result.outputs:
            tokens.setdefault(o.request_id, []).append(o.token_id)
        if not engine.running:
            break
        result = engine.step()
    # c0 computes the prompt; c1 and c2 wait behind each of its chunks, then compute only the
    # part of their last block.
    assert prefilled == len(prompt) + 2 * 6
    assert tokens == {r: c.token_ids for r, c in cold.items()}


def test_a_released_table_is_evicted_tail_first(fp32_model):
    rng = random.Random(10)
    prompt = _prompt(rng, 3 * BS + 1)
    cfg, _ = fp32_model
    engine = make_engine(fp32_model, kv_cache_bytes=4 * bytes_per_block(cfg, BS, torch.float32))
    generate(engine, [NewRequest("a", prompt, _greedy(1))])  # 3 blocks cached, 1 plain free
    alloc = engine.kv_cache.allocator
    alloc.free(alloc.allocate(2))  # the plain one, then one eviction: the table's last block
    hashes = block_hashes(prompt, BS)
    assert len(alloc.lookup(hashes)) == 2  # its head still found


def test_a_preempted_request_finds_its_prompt_and_output_cached(fp32_model):
    rng = random.Random(11)
    prompt = _prompt(rng, 2 * BS + 5)
    whole = generate(make_engine(fp32_model), [NewRequest("r", prompt, _greedy(30))])["r"].token_ids
    engine = make_engine(fp32_model)
    engine.step(IterationPlan(admit=[NewRequest("r", prompt, _greedy(30))]))
    for _ in range(19):
        engine.step()
    done = list(engine.running["r"].token_ids[len(prompt):])
    assert len(done) == 20
    engine.release("r")  # preempted; admitted again with its output, as the scheduler does
    hits = engine.prefix_cache_hits
    rest = generate(engine, [NewRequest("r", prompt, _greedy(30), done)])["r"].token_ids
    assert engine.prefix_cache_hits - hits == (len(prompt) + 20 - 1) // BS * BS
    assert done + rest == whole
