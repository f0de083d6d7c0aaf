"""Running requests through one in-process engine, without the fleet.

`shoal generate`, `shoal bench engine` and the tests use this: a small FCFS admission loop that
reserves K/V blocks for prompt + `max_tokens` at admission (Orca's reserve rule), so an iteration
never runs out of blocks. The fleet's scheduler (scheduler/) makes these decisions across workers;
this loop is its one-worker, in-process stand-in.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from shoal.messages import IterationPlan, NewRequest, TokenOutput
from worker.engine import Engine


@dataclass
class Completion:
    """A finished request: its generated tokens, their logprobs and why it stopped."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None


def stream(engine: Engine, requests: Iterable[NewRequest]) -> Iterator[TokenOutput]:
    """Run `requests` to completion, yielding every `TokenOutput` as its iteration ends.

    Requests are admitted first come, first served while fewer than `max_num_seqs` run and the
    blocks reserved for prompt + max_tokens of the running ones leave room.

    Raises:
        ValueError: a request could never fit in the K/V cache, even alone.
    """
    waiting = deque(requests)
    reserved: dict[str, int] = {}
    counter = itertools.count()
    while waiting or engine.running:
        admit = []
        free = engine.num_total_blocks - sum(reserved.values())
        while waiting and len(engine.running) + len(admit) < engine.cfg.max_num_seqs:
            req = waiting[0]
            need = engine.blocks_for_tokens(
                min(len(req.prompt_token_ids) + req.params.max_tokens, engine.max_model_len))
            if need > engine.num_total_blocks:
                raise ValueError(f"request {req.request_id} needs {need} K/V blocks; the cache "
                                 f"has {engine.num_total_blocks}")
            if need > free:
                break
            free -= need
            reserved[req.request_id] = need
            admit.append(waiting.popleft())
        result = engine.step(IterationPlan(iteration=next(counter), admit=admit))
        for out in result.outputs:
            if out.finish_reason is not None:
                reserved.pop(out.request_id, None)
            yield out


def generate(engine: Engine, requests: Iterable[NewRequest]) -> dict[str, Completion]:
    """Run `requests` to completion and collect each one's tokens (see `stream`)."""
    done: dict[str, Completion] = {}
    for out in stream(engine, requests):
        c = done.setdefault(out.request_id, Completion(out.request_id))
        if out.token_id is not None:
            c.token_ids.append(out.token_id)
            c.logprobs.append(out.logprob)
        c.finish_reason, c.error = out.finish_reason, out.error
    return done
