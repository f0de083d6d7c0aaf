"""Benchmark workloads, shared by `shoal bench engine` (in-process) and `shoal bench serve` (over
HTTP) so both measure exactly the same requests."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    """Requests with prompts of uniformly random length of random token ids and forced output
    lengths (EOS ignored).

    Attributes:
        name: label in reports.
        num_requests: how many requests.
        prompt_len: inclusive range of prompt lengths in tokens.
        output_len: inclusive range of output lengths in tokens.
    """

    name: str
    num_requests: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]


W64 = Workload("W64", 64, (32, 256), (1, 64))
W64_QUICK = Workload("W64-quick", 8, (16, 64), (1, 8))


@dataclass(frozen=True)
class BenchRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int


def make_requests(w: Workload, vocab_size: int, seed: int, prefix: str = "w") -> list[BenchRequest]:
    """The workload's requests, the same for the same seed."""
    rng = random.Random(seed)
    out = []
    for i in range(w.num_requests):
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(*w.prompt_len))]
        out.append(BenchRequest(f"{prefix}{i}", prompt, rng.randint(*w.output_len)))
    return out
