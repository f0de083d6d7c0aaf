"""The scheduling policy (scheduler/core.py) driving real engines in-process, iteration by iteration,
with the fleet's pipelining: one plan queued ahead of the one running."""

from __future__ import annotations

import random
from collections import deque
from pathlib import Path

import pytest
import torch

from scheduler.core import LORA_GRACE_S, Scheduler
from shoal.messages import IterationResult, RequestSubmission, WorkerInfo
from shoal.sampling_params import SamplingParams
from tests.conftest import random_weights, tiny_config
from worker.config import EngineConfig
from worker.engine import Engine
from worker.kv_cache import bytes_per_block
from worker.server import WorkerServer, WorkerSettings

CFG = tiny_config()
WEIGHTS = random_weights(CFG)
BLOCK = 4


class SimWorker:
    """The worker's own step logic (WorkerServer.step, preemption included) over a real engine,
    fed by the scheduler's plans, two in flight like the fleet's; Redis is not touched."""

    def __init__(self, wid: str, num_blocks: int) -> None:
        self.wid = wid
        kv = num_blocks * bytes_per_block(CFG, BLOCK, torch.float32)
        self.engine = Engine(CFG, WEIGHTS, EngineConfig(dtype=torch.float32, block_size=BLOCK,
                                                       kv_cache_bytes=kv, max_num_seqs=8))
        self.server = WorkerServer(self.engine, Path("m.gguf"),
                                   WorkerSettings("redis://unused", worker_id=wid))
        self.queue: deque = deque()
        self.iterations = 0

    def info(self) -> WorkerInfo:
        e = self.engine
        return WorkerInfo(self.wid, "m", e.num_total_blocks, e.num_free_blocks, BLOCK, 8, 256,
                          len(e.running))

    def run_one(self):
        self.iterations += 1
        return self.server.step(self.queue.popleft())


def _sub(rid, prompt_len, max_tokens, t):
    # Each request its own prompt: requests that share one wait for the prefix cache
    # (Engine._schedule), which is not what these tests are about.
    rng = random.Random(rid)
    return RequestSubmission(rid, "m", [rng.randrange(2, CFG.vocab_size) for _ in range(prompt_len)],
                             SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                             t, "reply")


def _pump(sched: Scheduler, workers: dict[str, SimWorker], events: list) -> None:
    """The scheduler server's loop body: place, keep two plans ahead, run one iteration each."""
    sched.place()
    for wid, w in workers.items():
        while len(w.queue) < 2 and sched.has_work(wid):
            w.queue.append(sched.schedule(wid))
    for wid, w in workers.items():
        if w.queue:
            events += sched.postprocess(w.run_one())


def test_placement_follows_free_kv():
    sched = Scheduler("reserve")
    workers = {"big": SimWorker("big", 40), "small": SimWorker("small", 20)}
    for w in workers.values():
        sched.update_worker(w.info())
    # Each request reserves (12 + 8) / 4 = 5 blocks.
    for i in range(6):
        sched.add_request(_sub(f"r{i}", 12, 8, float(i)))
    sched.place()
    placed = {rid: s.worker_id for rid, s in sched.requests.items()}
    # big (40) takes requests until its room equals small's (20), then they alternate.
    assert [placed[f"r{i}"] for i in range(6)] == ["big", "big", "big", "big", "small", "big"]
    assert sched.workers["big"].reserved_blocks == 25 and sched.workers["small"].reserved_blocks == 5


def test_fcfs_head_waits_for_room_and_is_not_overtaken():
    sched = Scheduler("reserve")
    w = SimWorker("w", 10)
    sched.update_worker(w.info())
    sched.add_request(_sub("a", 20, 8, 0.0))  # 7 blocks
    sched.add_request(_sub("b", 20, 8, 1.0))  # 7 blocks: does not fit beside a
    sched.add_request(_sub("c", 2, 2, 2.0))  # 1 block: would fit, but must not overtake b
    sched.place()
    assert [sched.requests[r].worker_id for r in "abc"] == ["w", None, None]
    events: list = []
    workers = {"w": w}
    while "a" in sched.requests:
        _pump(sched, workers, events)
    sched.place()
    assert sched.requests["b"].worker_id == "w"


def test_models_queue_apart_a_full_model_holds_back_only_its_own_requests():
    """Requests go only to workers of their model; the head of one model's queue waiting for
    room, or for any worker at all, holds back that model's later requests but not other
    models' (no head-of-line blocking across models); within a model, FCFS still holds."""
    from dataclasses import replace

    sched = Scheduler("reserve")
    wa, wb = WorkerInfo("wa", "a", 10, 10, BLOCK, 8, 256), WorkerInfo("wb", "b", 10, 10, BLOCK, 8, 256)
    sched.update_worker(wa)
    sched.update_worker(wb)

    def sub(rid, model, prompt_len, t):
        return replace(_sub(rid, prompt_len, 8, t), model=model)

    sched.add_request(sub("a1", "a", 20, 0.0))  # 7 of wa's 10 blocks
    sched.add_request(sub("a2", "a", 20, 1.0))  # 7 more: waits for a1
    sched.add_request(sub("c1", "c", 2, 2.0))  # no worker serves model c: waits
    sched.add_request(sub("b1", "b", 20, 3.0))  # 7 of wb's
    sched.add_request(sub("a3", "a", 2, 4.0))  # 3 blocks would fit on wa, but a2 is ahead
    sched.add_request(sub("b2", "b", 2, 5.0))  # 3 blocks: fits on wb
    placed = [s.sub.request_id for s in sched.place()]
    assert placed == ["a1", "b1", "b2"]
    assert {r: s.worker_id for r, s in sched.requests.items()} == {
        "a1": "wa", "a2": None, "c1": None, "b1": "wb", "a3": None, "b2": "wb"}
    assert [s.sub.request_id for s in sched.waiting] == ["a2", "c1", "a3"]
    assert sched.waiting_by_model() == {"a": 2, "c": 1, "b": 0}  # shoal_requests_waiting
    sched.update_worker(WorkerInfo("wc", "c", 10, 10, BLOCK, 8, 256))
    assert [s.sub.request_id for s in sched.place()] == ["c1"]
    assert sched.requests["c1"].worker_id == "wc"


def test_a_lora_request_goes_only_where_its_adapter_is_served():
    """A request naming a LoRA adapter is placed on a worker advertising it (`WorkerInfo.loras`)
    even where another has more room, and fails with 404 where no worker of its model has
    served it for LORA_GRACE_S; the base model's requests go anywhere."""
    from dataclasses import replace

    sched = Scheduler("reserve")
    sched.update_worker(WorkerInfo("plain", "m", 40, 40, BLOCK, 8, 256))
    sched.update_worker(WorkerInfo("tuned", "m", 10, 10, BLOCK, 8, 256, loras={"sql": "/a/sql"}))

    def sub(rid, lora, t):
        s = _sub(rid, 4, 4, t)
        return replace(s, params=replace(s.params, lora_name=lora))

    for rid, lora in (("base", None), ("sql", "sql"), ("chat", "chat")):
        sched.add_request(sub(rid, lora, float(len(sched.requests))))
    placed = {s.sub.request_id: s.worker_id for s in sched.place(now=2.0)}
    assert placed == {"base": "plain", "sql": "tuned"}
    assert not sched.failed  # "chat" may yet be loaded: it waits LORA_GRACE_S
    assert not sched.place(now=3.0 + LORA_GRACE_S)  # it arrived at 2.0
    [event] = sched.failed
    assert event.request_id == "chat" and event.error_status == 404 and "'chat'" in event.error
    assert "chat" not in sched.requests and not sched.waiting


def test_new_request_gets_its_first_token_within_two_iterations():
    sched = Scheduler("reserve")
    w = SimWorker("w", 200)
    sched.update_worker(w.info())
    workers = {"w": w}
    events: list = []
    for i in range(4):
        sched.add_request(_sub(f"long{i}", 10, 40, float(i)))
    for _ in range(5):
        _pump(sched, workers, events)
    arrival_iteration = w.iterations
    sched.add_request(_sub("late", 9, 5, 10.0))
    while not any(e.request_id == "late" and e.token_ids for e in events):
        _pump(sched, workers, events)
    assert w.iterations - arrival_iteration <= 2
    # The others kept decoding meanwhile: one token per iteration each.
    assert all(len(sched.requests[f"long{i}"].output_token_ids) == w.iterations for i in range(4))


def test_early_finisher_leaves_at_once_and_frees_its_blocks():
    sched = Scheduler("reserve")
    w = SimWorker("w", 100)
    sched.update_worker(w.info())
    workers = {"w": w}
    events: list = []
    sched.add_request(_sub("short", 8, 1, 0.0))
    sched.add_request(_sub("long", 8, 12, 1.0))
    _pump(sched, workers, events)
    done = [e for e in events if e.finish_reason]
    assert [e.request_id for e in done] == ["short"] and done[0].completion_tokens == 1
    assert "short" not in w.engine.running and "short" not in sched.requests
    assert sched.workers["w"].reserved_blocks == -(-(8 + 12) // BLOCK)
    assert w.engine.num_free_blocks == w.engine.num_total_blocks - len(w.engine.running["long"].block_table)
    while "long" in sched.requests:
        _pump(sched, workers, events)
    tokens = [t for e in events if e.request_id == "long" for t in e.token_ids]
    assert len(tokens) == 12 and [e.index for e in events if e.request_id == "long"] == list(range(12))
    assert w.engine.num_free_blocks == w.engine.num_total_blocks


def test_dead_worker_requests_return_to_the_pool_with_their_tokens():
    sched = Scheduler("reserve")
    a, b = SimWorker("a", 50), SimWorker("b", 40)
    for w in (a, b):
        sched.update_worker(w.info())
    sched.add_request(_sub("r", 10, 10, 0.0))
    events: list = []
    for _ in range(4):
        _pump(sched, {"a": a}, events)
    assert sched.requests["r"].worker_id == "a"
    before = list(sched.requests["r"].output_token_ids)
    assert len(before) >= 3
    assert sched.remove_worker("a") == []
    assert sched.requests["r"].worker_id is None
    while "r" in sched.requests:
        _pump(sched, {"b": b}, events)
    tokens = {}
    for e in events:
        for k, t in enumerate(e.token_ids):
            tokens.setdefault(e.index + k, t)
    # Greedy output is the same as an undisturbed run on one worker.
    solo = Scheduler("reserve")
    c = SimWorker("c", 50)
    solo.update_worker(c.info())
    solo.add_request(_sub("r", 10, 10, 0.0))
    ev2: list = []
    while "r" in solo.requests:
        _pump(solo, {"c": c}, ev2)
    assert [tokens[i] for i in range(10)] == [t for e in ev2 for t in e.token_ids]


def _run_alone(sched: Scheduler, subs: list, num_blocks: int = 100) -> list:
    w = SimWorker("w", num_blocks)
    sched.update_worker(w.info())
    for sub in subs:
        sched.add_request(sub)
    events: list = []
    while sched.requests:
        _pump(sched, {"w": w}, events)
    return events


def test_stream_interval_sends_the_first_token_at_once_then_tokens_in_groups():
    """`stream_interval` 4: each request's first token alone, then events of 4 tokens, the last
    event with the rest; the same tokens, indexes and usage as events of one token each."""
    subs = [_sub("a", 8, 11, 0.0), _sub("b", 6, 2, 1.0), _sub("c", 9, 5, 2.0)]
    each = _run_alone(Scheduler("reserve"), subs)
    grouped = _run_alone(Scheduler("reserve", stream_interval=4), subs)
    for rid, max_tokens in (("a", 11), ("b", 2), ("c", 5)):
        one = [e for e in each if e.request_id == rid and (e.token_ids or e.finish_reason)]
        four = [e for e in grouped if e.request_id == rid and (e.token_ids or e.finish_reason)]
        assert [len(e.token_ids) for e in one] == [1] * max_tokens
        sizes = [1] + [4] * ((max_tokens - 1) // 4) + ([(max_tokens - 1) % 4]
                                                       if (max_tokens - 1) % 4 else [])
        assert [len(e.token_ids) for e in four] == sizes, rid
        assert [t for e in four for t in e.token_ids] == [t for e in one for t in e.token_ids]
        assert [e.index for e in four] == [sum(sizes[:k]) for k in range(len(sizes))]
        assert [len(e.logprobs) for e in four] == sizes
        assert four[-1].finish_reason == one[-1].finish_reason == "length"
        assert four[-1].completion_tokens == max_tokens
        assert all(e.finish_reason is None for e in four[:-1])
    with pytest.raises(ValueError, match="stream_interval"):
        Scheduler("reserve", stream_interval=0)


def test_held_tokens_go_before_an_error_and_survive_a_lost_worker():
    """Tokens held under a `stream_interval` are published ahead of a request's failure (in an
    event of their own: the gateway reads no tokens from an error), and a request moved off a
    lost worker keeps holding them and goes on from them."""
    sched = Scheduler("reserve", max_migrations=1, stream_interval=8)
    a, b, c = SimWorker("a", 50), SimWorker("b", 50), SimWorker("c", 50)
    for w in (a, b, c):
        sched.update_worker(w.info())
    sched.add_request(_sub("r", 10, 30, 0.0))
    events: list = []
    for _ in range(4):
        _pump(sched, {"a": a}, events)
    assert [len(e.token_ids) for e in events if e.token_ids] == [1]  # the rest is held
    assert sched.requests["r"].held is not None
    assert sched.remove_worker("a") == []  # back to the pool: still held
    for _ in range(4):
        _pump(sched, {"b": b}, events)
    held = len(sched.requests["r"].output_token_ids) - 1
    assert held >= 4 and len(sched.requests["r"].held.token_ids) == held
    failed = sched.remove_worker("b")  # its second migration: over the limit
    assert [(len(e.token_ids), e.finish_reason) for e in failed] == [(held, None), (0, "error")]
    assert failed[0].index == 1
    assert [t for e in events + failed for t in e.token_ids] == \
        sched.dropped[-1].output_token_ids


def test_ondemand_preempts_and_recomputes():
    """Under `ondemand` a worker that runs out hands its newest request back; it is recomputed
    and finishes with every token index exactly once."""

    sched = Scheduler("ondemand")
    w = SimWorker("w", 12)
    sched.update_worker(w.info())
    for i in range(3):
        sched.add_request(_sub(f"r{i}", 8, 16, float(i)))
    events: list = []
    preempted = 0
    while sched.requests:
        _pump(sched, {"w": w}, events)
        preempted += sum(1 for p in sched.requests.values() if p.worker_id is None)
    assert not sched.requests and preempted > 0
    assert w.engine.num_free_blocks == w.engine.num_total_blocks
    for i in range(3):
        toks = {}
        for e in events:
            if e.request_id == f"r{i}":
                for k, t in enumerate(e.token_ids):
                    toks.setdefault(e.index + k, t)
        assert sorted(toks) == list(range(16))


def test_a_request_migrated_too_often_fails_clearly():
    sched = Scheduler("reserve", max_migrations=1)
    sched.add_request(_sub("r", 4, 4, 0.0))
    for wid, expect_fail in (("a", False), ("b", True)):
        w = SimWorker(wid, 20)
        sched.update_worker(w.info())
        sched.place()
        assert sched.requests["r"].worker_id == wid
        failed = sched.remove_worker(wid)
        if expect_fail:
            assert [e.finish_reason for e in failed] == ["error"] and "lost 2 times" in failed[0].error
            assert "r" not in sched.requests and not sched.waiting
        else:
            assert failed == [] and sched.requests["r"].migrations == 1


def test_queue_deadline_fails_requests_that_wait_too_long():
    sched = Scheduler("reserve", queue_deadline_s=5.0)
    w = SimWorker("w", 10)
    sched.update_worker(w.info())
    sched.add_request(_sub("big", 20, 8, 100.0))  # 7 of 10 blocks
    sched.add_request(_sub("late", 20, 8, 101.0))  # must wait for "big"
    sched.place()
    sched.expire(now=104.0)
    assert sched.failed == [] and "late" in sched.requests
    sched.expire(now=106.5)  # "late" has waited 5.5 s; "big" runs and is not affected
    assert [(e.request_id, e.finish_reason, e.error_status) for e in sched.failed] == [("late", "error", 503)]
    assert "waited more than 5 s" in sched.failed[0].error
    assert "late" not in sched.requests and "big" in sched.requests and not sched.waiting


def _prio_sub(rid: str, t: float, priority: int) -> RequestSubmission:
    return RequestSubmission(rid, "m", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0),
                             t, "reply", priority)


def _placed_order(sched: Scheduler, now: float, slots: int) -> list[str]:
    """Place one request at a time on a worker with one slot, freeing it in between."""
    order = []
    for _ in range(slots):
        sched.update_worker(WorkerInfo("w", "m", 100, 100, BLOCK, 1, 256, 0))
        placed = sched.place(now)
        assert len(placed) == 1
        order.append(placed[0].sub.request_id)
        sched.workers["w"].running.clear()
        sched.workers["w"].reserved_blocks = 0
        sched.workers["w"].to_admit.clear()
    return order


def test_lower_priority_value_first_fcfs_within_a_priority():
    sched = Scheduler(priority_aging_s=30.0)
    for i in range(3):
        sched.add_request(_prio_sub(f"batch{i}", t=100.0 + i, priority=1))
    sched.add_request(_prio_sub("chat0", t=104.0, priority=0))
    sched.add_request(_prio_sub("chat1", t=105.0, priority=0))
    # Interactive requests overtake batch ones that waited less than the aging period.
    assert _placed_order(sched, now=110.0, slots=5) == ["chat0", "chat1", "batch0", "batch1", "batch2"]


def test_aging_keeps_batch_work_from_starving():
    sched = Scheduler(priority_aging_s=30.0)
    sched.add_request(_prio_sub("batch0", t=100.0, priority=1))
    sched.add_request(_prio_sub("batch1", t=125.0, priority=1))
    sched.add_request(_prio_sub("chat0", t=128.0, priority=0))
    # At 131 s batch0 has waited 31 s: one level up, it ties with interactive work and, having
    # arrived first, goes first; batch1 (waited 6 s) still yields to chat0.
    assert _placed_order(sched, now=131.0, slots=3) == ["batch0", "chat0", "batch1"]
    strict = Scheduler(priority_aging_s=0.0)
    strict.add_request(_prio_sub("batch0", t=100.0, priority=1))
    strict.add_request(_prio_sub("chat0", t=128.0, priority=0))
    assert _placed_order(strict, now=1000.0, slots=2) == ["chat0", "batch0"]


def test_request_level_policy_holds_new_requests_until_the_batch_ends():
    """Orca's baseline: a worker's batch is fixed when it starts; arrivals wait for its end."""
    sched = Scheduler(policy="request-level")
    w = SimWorker("w0", num_blocks=64)
    sched.update_worker(w.info())
    for i in range(3):
        sched.add_request(_sub(f"first{i}", 6, 2 + 3 * i, t=float(i)))  # 2, 5 and 8 tokens
    events: list = []
    _pump(sched, {"w0": w}, events)
    assert sched.workers["w0"].running == {"first0", "first1", "first2"}
    sched.add_request(_sub("late", 6, 2, t=10.0))
    finished: list[str] = []
    while sched.workers["w0"].running:
        running_before = set(sched.workers["w0"].running)
        _pump(sched, {"w0": w}, events)
        finished += [e.request_id for e in events if e.finish_reason]
        events.clear()
        if "late" in sched.workers["w0"].running:
            assert not running_before - {"late"}, "late joined while the batch still ran"
            break
        # While any request of the first batch runs, the newcomer waits.
        assert "late" not in sched.workers["w0"].running
    assert set(finished) >= {"first0", "first1", "first2"}
    assert [s.sub.request_id for s in sched.waiting] in ([], ["late"])
    _pump(sched, {"w0": w}, events)
    assert "late" in sched.workers["w0"].running or any(e.request_id == "late" for e in events)


def _plan_due_scheduler(budget: int) -> Scheduler:
    sched = Scheduler("reserve")
    sched.update_worker(WorkerInfo("w", "m", 1000, 1000, BLOCK, 8, 256, 0,
                                   max_num_batched_tokens=budget))
    return sched


def test_the_plan_behind_a_prefill_is_due_shortly_before_its_estimated_end():
    """`plan_due` from the lowest recent seconds per token of prefill iterations, the prompt
    tokens the running iteration computes (capped by the worker's budget) and its requests."""
    sched = _plan_due_scheduler(budget=64)
    sched.add_request(_sub("a", 40, 5, 1.0))
    sched.place()
    sched.schedule("w")
    sched.iteration_started("w", now=100.0)
    assert sched.plan_due("w", 100.0) == 100.0  # nothing measured yet: at once
    for seconds in (0.4, 0.2, 0.3):  # 200 prompt tokens each: 2, 1 and 1.5 ms a token
        sched.postprocess(IterationResult("w", 0, [], 1000, 200, 0, seconds))
    sched.iteration_started("w", now=100.0)
    # 40 prompt tokens + 1 request at 1 ms: 41 ms, due 10 ms (PLAN_LEAD_S) before the end.
    assert sched.plan_due("w", 100.0) == pytest.approx(100.031)
    # A prompt longer than the budget: the iteration computes 64 of its tokens.
    sched.postprocess(IterationResult("w", 1, [], 1000, 200, 0, 0.2,
                                      num_pending_prefill_tokens=5000))
    sched.schedule("w")  # admits nothing
    sched.iteration_started("w", now=200.0)
    assert sched.plan_due("w", 200.0) == pytest.approx(200.0 + 0.065 * 0.8)  # a fifth early
    # Decode only: the plan behind it goes at once.
    sched.postprocess(IterationResult("w", 2, [], 1000, 0, 1, 0.02))
    sched.schedule("w")
    sched.iteration_started("w", now=300.0)
    assert sched.plan_due("w", 300.0) == 300.0


def _caching_worker(wid: str, blocks: int, incarnation: str = "i0",
                    prefix_caching: bool = True) -> WorkerInfo:
    return WorkerInfo(wid, "m", blocks, blocks, BLOCK, 64, 256, incarnation=incarnation,
                      prefix_caching=prefix_caching)


def _behind(stem: list[int], rid: str, t: float, salt: str | None = None) -> RequestSubmission:
    """A request whose prompt is `stem` and three tokens of its own: 12 blocks with max_tokens."""
    rng = random.Random(rid)
    return RequestSubmission(rid, "m", stem + [rng.randrange(2, CFG.vocab_size) for _ in range(3)],
                             SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                            cache_salt=salt), t, "reply")


def _place(sched: Scheduler, sub: RequestSubmission) -> str:
    sched.add_request(sub)
    sched.place()
    return sched.requests[sub.request_id].worker_id


def test_requests_follow_their_cached_prefix_while_the_load_is_near_even():
    rng = random.Random(0)
    stem = [rng.randrange(2, CFG.vocab_size) for _ in range(40)]

    def two_workers() -> tuple[Scheduler, str, str]:
        sched = Scheduler("reserve")
        for wid in ("a", "b"):
            sched.update_worker(_caching_worker(wid, 200))  # slack: 25 blocks
        home = _place(sched, _behind(stem, "s0", 0.0))
        return sched, home, "b" if home == "a" else "a"

    # Rooms 188 and 176 against 200: within the slack, so the prefix's worker takes them.
    sched, home, other = two_workers()
    assert [_place(sched, _behind(stem, f"s{i}", float(i))) for i in (1, 2)] == [home, home]
    # 164 against 200 is not: the roomiest takes it, and from then on both hold the prefix
    # (equal runs: the roomier wins).
    assert _place(sched, _behind(stem, "s3", 3.0)) == other
    assert _place(sched, _behind(stem, "s4", 4.0)) == other
    assert (sched.workers[home].reserved_blocks, sched.workers[other].reserved_blocks) == (36, 24)
    # A prompt of its own goes where the room is; so does the same prompt under another salt.
    for sub in (_behind([7] * 40, "own", 1.0), _behind(stem, "salted", 1.0, salt="t")):
        sched, home, other = two_workers()
        assert _place(sched, sub) == other


def test_placement_ignores_prefixes_of_workers_that_do_not_cache_or_restarted():
    rng = random.Random(1)
    stem = [rng.randrange(2, CFG.vocab_size) for _ in range(40)]
    sched = Scheduler("reserve")
    for wid in ("a", "b"):
        sched.update_worker(_caching_worker(wid, 200, prefix_caching=False))
    first = _place(sched, _behind(stem, "s0", 0.0))
    assert _place(sched, _behind(stem, "s1", 1.0)) != first  # by free K/V alone

    sched = Scheduler("reserve")
    for wid in ("a", "b"):
        sched.update_worker(_caching_worker(wid, 200))
    first = _place(sched, _behind(stem, "s0", 0.0))
    assert _place(sched, _behind(stem, "s1", 1.0)) == first
    sched.update_worker(_caching_worker(first, 200, incarnation="i1"))  # a new process
    assert _place(sched, _behind(stem, "s2", 2.0)) != first


def test_events_carry_the_prompt_tokens_found_cached():
    sched = Scheduler("reserve")
    w = SimWorker("w", 100)
    sched.update_worker(w.info())
    stem = [random.Random(2).randrange(2, CFG.vocab_size) for _ in range(12)]
    events: list = []
    for rid in ("first", "again"):  # one after the other: the second finds 12 of 15 cached
        sched.add_request(_behind(stem, rid, 0.0))
        while rid in sched.requests:
            _pump(sched, {"w": w}, events)
    last = {e.request_id: e for e in events if e.finish_reason}
    assert (last["first"].cached_tokens, last["again"].cached_tokens) == (0, 12)


def test_a_shared_prefix_does_not_pile_every_request_onto_one_worker():
    """Large pools: 24 requests behind one prompt are well within the room slack, so only the
    request guard spreads them."""
    from scheduler.core import PREFIX_AFFINITY_REQUESTS

    sched = Scheduler("reserve")
    for wid in ("a", "b"):
        sched.update_worker(_caching_worker(wid, 6400))
    stem = [random.Random(3).randrange(2, CFG.vocab_size) for _ in range(40)]
    placed = [_place(sched, _behind(stem, f"s{i}", float(i))) for i in range(24)]
    home = placed[0]
    # The prefix's worker takes requests until it runs PREFIX_AFFINITY_REQUESTS more than the
    # other; from then on both hold the prefix and share the rest within that margin.
    assert placed[:PREFIX_AFFINITY_REQUESTS] == [home] * PREFIX_AFFINITY_REQUESTS
    assert placed[PREFIX_AFFINITY_REQUESTS] != home
    counts = [len(sched.workers[w].running) for w in ("a", "b")]
    assert abs(counts[0] - counts[1]) <= PREFIX_AFFINITY_REQUESTS and sum(counts) == 24


def test_a_workers_prefix_index_keeps_its_most_recent_blocks():
    from scheduler.core import PrefixIndex

    index = PrefixIndex()
    index.add([b"a", b"b", b"c"], capacity=4)
    index.add([b"a", b"d"], capacity=4)  # "a" made recent again, "d" new: four held
    assert index.match([b"a", b"b", b"c", b"d"]) == 4
    index.add([b"e"], capacity=4)  # "b", the least recent, goes
    assert index.match([b"a", b"b"]) == 1 and index.match([b"c", b"d", b"e"]) == 3


def _tokens(events: list, rid: str) -> list[int]:
    out: list[int] = []
    for e in events:
        if e.request_id == rid:
            out[e.index:] = e.token_ids
    return out


@pytest.mark.parametrize("when", ["before", "after"])
def test_an_engine_failure_fails_only_the_request_that_breaks_it(monkeypatch, when):
    """A step that raises with a request that breaks the engine among others ("before" its
    forward pass, or "after" the others' tokens were sampled and appended): the worker frees
    every block, finds the culprit by recomputing halves of the requests alone, and fails it
    alone with status 500; the others go on, their tokens exactly those of a run without it
    (none lost, none twice). Failing MAX_FAILED_ITERATIONS iterations in a row ends the
    worker."""
    from worker import server as worker_server

    names = ["a", "b", "poison", "c", "d"]
    oracle: list = []
    sched = Scheduler("reserve")
    clean = SimWorker("w", 60)
    sched.update_worker(clean.info())
    for i, rid in enumerate(n for n in names if n != "poison"):
        sched.add_request(_sub(rid, 6, 4, float(i)))
    while sched.requests:
        _pump(sched, {"w": clean}, oracle)

    sched = Scheduler("reserve")
    w = SimWorker("w", 60)
    sched.update_worker(w.info())
    run = w.engine._run
    armed = [False]  # the poison breaks the engine from its second token on

    def poisoned(decodes, prefills):
        seqs = [*decodes, *(s for s, _ in prefills)]
        hit = armed[0] and any(s.request_id == "poison" for s in seqs)
        armed[0] = armed[0] or any(s.request_id == "poison" for s in seqs)
        if hit and when == "before":
            raise RuntimeError("the kernel refused a value")
        out = run(decodes, prefills)
        if hit:
            raise RuntimeError("the kernel refused a value")
        return out
    monkeypatch.setattr(w.engine, "_run", poisoned)
    for i, rid in enumerate(names):
        sched.add_request(_sub(rid, 6, 4, float(i)))
    events: list = []
    workers = {"w": w}
    from worker.metrics import FAILED_ITERATIONS, FAILED_REQUESTS

    before = FAILED_ITERATIONS._value.get(), FAILED_REQUESTS._value.get()
    while sched.requests:
        _pump(sched, workers, events)
    # shoal_engine_failed_iterations_total and shoal_engine_failed_requests_total
    assert (FAILED_ITERATIONS._value.get(), FAILED_REQUESTS._value.get()) == \
        (before[0] + 1, before[1] + 1)
    failed = {e.request_id: e for e in events if e.finish_reason == "error"}
    assert list(failed) == ["poison"]
    assert failed["poison"].error_status == 500 and "RuntimeError" in failed["poison"].error
    for rid in ("a", "b", "c", "d"):
        assert _tokens(events, rid) == _tokens(oracle, rid) and len(_tokens(oracle, rid)) == 4
        assert [e.finish_reason for e in events if e.request_id == rid][-1] == "length"
    assert w.engine.num_free_blocks == w.engine.num_total_blocks and not w.engine.running
    assert w.server._failed_in_a_row == 0  # the others ran: the engine works

    ended = []
    monkeypatch.setattr(w.server, "fail", lambda reason: ended.append(reason))
    for k in range(worker_server.MAX_FAILED_ITERATIONS):
        sched.add_request(_sub(f"poison{k}", 6, 4, 4.0 + k))
        monkeypatch.setattr(w.engine, "_run", lambda d, p: (_ for _ in ()).throw(
            RuntimeError("broken")))
        while sched.requests:
            _pump(sched, workers, events)
    assert len(ended) == 1 and "in a row" in ended[0]
