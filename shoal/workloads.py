"""Benchmark workloads, shared by `shoal bench engine` (in-process) and `shoal bench serve` (over
HTTP) so both measure exactly the same requests."""

from __future__ import annotations

import dataclasses
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
# The Orca paper's synthetic workload (OSDI'22, §6.2): prompts uniform in [32, 512] tokens,
# outputs uniform in [1, 128], forced.
ORCA = Workload("orca", 64, (32, 512), (1, 128))


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload. `prompt_text`, when set, is sent instead of the token ids
    (requests read from a JSONL file). Greedy unless `temperature` is above 0 (`with_sampling`)."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    prompt_text: str | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


def with_sampling(reqs: list[BenchRequest], temperature: float, top_p: float) -> list[BenchRequest]:
    """The same requests sampling at `temperature` (0: greedy) within `top_p`, request i seeded
    with i, so that runs draw the same tokens."""
    return [dataclasses.replace(r, temperature=temperature, top_p=top_p, seed=i)
            for i, r in enumerate(reqs)]


def with_shared_prefix(reqs: list[BenchRequest], num_tokens: int, vocab_size: int,
                       seed: int) -> list[BenchRequest]:
    """The same requests, each prompt behind one run of `num_tokens` random token ids that all
    share (a system prompt: what prefix caching saves).

    Raises:
        ValueError: a request is text (read from a file), which has no token ids to extend.
    """
    if not num_tokens:
        return reqs
    if any(r.prompt_text is not None for r in reqs):
        raise ValueError("a shared prefix extends generated workloads, not text prompts")
    rng = random.Random(f"shared-prefix-{seed}")
    prefix = [rng.randrange(vocab_size) for _ in range(num_tokens)]
    return [dataclasses.replace(r, prompt_token_ids=prefix + r.prompt_token_ids) for r in reqs]


def make_requests(w: Workload, vocab_size: int, seed: int, prefix: str = "w") -> list[BenchRequest]:
    """The workload's requests, the same for the same seed."""
    rng = random.Random(seed)
    out = []
    for i in range(w.num_requests):
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(*w.prompt_len))]
        out.append(BenchRequest(f"{prefix}{i}", prompt, rng.randint(*w.output_len)))
    return out


def read_requests(path: str, prefix: str = "f") -> list[BenchRequest]:
    """Requests from a JSONL file: one `{"prompt": text or token ids, "max_tokens": n}` a line.

    Raises:
        ValueError: a line is not such an object (its number is in the message).
        OSError: the file cannot be read.
    """
    import json

    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                prompt, max_tokens = d["prompt"], int(d["max_tokens"])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: expected {{\"prompt\", \"max_tokens\"}}: {e}") from e
            if isinstance(prompt, str):
                out.append(BenchRequest(f"{prefix}{n}", [], max_tokens, prompt))
            elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                out.append(BenchRequest(f"{prefix}{n}", prompt, max_tokens))
            else:
                raise ValueError(f"{path}:{n}: prompt must be text or a list of token ids")
    if not out:
        raise ValueError(f"{path}: no requests")
    return out
