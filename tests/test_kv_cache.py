"""Block accounting under random admit / step / release sequences (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.messages import NewRequest
from shoal.sampling_params import SamplingParams
from tests.conftest import tiny_config, tiny_engine
from worker.engine import Engine
from worker.kv_cache import BlockAllocator, KVCacheFullError

CFG = tiny_config()
NUM_BLOCKS = 12
BLOCK = 4


def _engine() -> Engine:
    return tiny_engine(NUM_BLOCKS, BLOCK, max_num_batched_tokens=16)


def _check_invariants(engine: Engine) -> None:
    owned = [b for s in engine.running.values() for b in s.block_table]
    assert len(owned) == len(set(owned)), "a block is owned twice"
    assert all(0 <= b < NUM_BLOCKS for b in owned)
    assert len(owned) + engine.num_free_blocks == engine.num_total_blocks
    for s in engine.running.values():
        # A request owns exactly the blocks its computed tokens need, never more.
        assert len(s.block_table) == -(-s.num_computed_tokens // BLOCK)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.integers(1, 30), st.integers(1, 12)),
        st.tuples(st.just("step"), st.just(0), st.just(0)),
        st.tuples(st.just("release"), st.integers(0, 20), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_random_admit_step_release_keeps_blocks_consistent(sequence):
    engine = _engine()
    n = 0
    for op, a, b in sequence:
        if op == "admit":
            prompt = [(n * 7 + j) % (CFG.vocab_size - 2) + 2 for j in range(a)]
            engine.add_request(NewRequest(f"r{n}", prompt, SamplingParams(max_tokens=b, temperature=0.0)))
            n += 1
        elif op == "step":
            free_before = engine.num_free_blocks
            tables = {r: list(s.block_table) for r, s in engine.running.items()}
            try:
                engine.step()
            except KVCacheFullError:
                # Documented: nothing allocated, nothing computed.
                assert engine.num_free_blocks == free_before
                assert {r: s.block_table for r, s in engine.running.items()} == tables
                # The caller preempts the newest request and goes on.
                engine.release(list(engine.running)[-1])
        else:
            ids = list(engine.running)
            if ids:
                engine.release(ids[a % len(ids)])
        _check_invariants(engine)
    for rid in list(engine.running):
        engine.release(rid)
    assert engine.num_free_blocks == engine.num_total_blocks


def test_exhausted_pool_raises_the_documented_error():
    engine = _engine()
    # 60 prompt tokens need 15 blocks of 4; the pool has 12.
    engine.add_request(NewRequest("big", list(range(2, 62)), SamplingParams(max_tokens=1, temperature=0.0)))
    engine.step()  # 16 tokens fit (4 blocks)
    engine.step()
    engine.step()  # 48 tokens, 12 blocks: the pool is full
    assert engine.num_free_blocks == 0
    with pytest.raises(KVCacheFullError):
        engine.step()
    engine.release("big")
    assert engine.num_free_blocks == NUM_BLOCKS


def test_allocator_refuses_double_free_and_overdraw():
    a = BlockAllocator(3)
    blocks = a.allocate(2)
    with pytest.raises(KVCacheFullError):
        a.allocate(2)
    assert a.num_free_blocks == 1
    a.free(blocks)
    with pytest.raises(ValueError):
        a.free(blocks[:1])
    assert a.num_free_blocks == 3


def test_finished_requests_free_their_blocks_at_once():
    engine = _engine()
    engine.add_request(NewRequest("a", [5, 6, 7], SamplingParams(max_tokens=1, temperature=0.0)))
    engine.add_request(NewRequest("b", [5, 6, 7, 8, 9], SamplingParams(max_tokens=5, temperature=0.0,
                                                                       ignore_eos=True)))
    res = engine.step()
    assert {o.request_id: o.finish_reason for o in res.outputs} == {"a": "length", "b": None}
    assert "a" not in engine.running
    assert engine.num_free_blocks == NUM_BLOCKS - len(engine.running["b"].block_table)


def test_allocator_hands_out_the_lowest_free_blocks_first():
    """Blocks freed in any order come back lowest first, so the blocks one allocation takes are
    ascending and adjacent where the free space allows (decode attention reads a request's
    blocks in turn; scattered ones ran 17% slower)."""
    a = BlockAllocator(64)
    first, second, third = a.allocate(10), a.allocate(10), a.allocate(10)
    assert first == list(range(10)) and third == list(range(20, 30))
    a.free(first[::-1])  # in the order requests happen to finish
    a.free([second[7], second[2], second[5]])
    assert a.allocate(13) == [*range(10), 12, 15, 17]
    assert a.allocate(3) == [30, 31, 32]
