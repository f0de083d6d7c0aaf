"""Sampling the next token of every request in the batch at once.

Penalties on tokens a request has seen come first (repetition, then frequency and presence, in
vLLM's order). Greedy rows take the argmax. Other rows are scaled by temperature, cut by top-k and top-p over one
shared sort, and sampled with the exponential-race form of the Gumbel-max trick
(`argmax(p / E)`, `E ~ Exp(1)`), drawing `E` from the request's own `torch.Generator`. Each
request's noise depends only on its seed and how many tokens it has sampled, so the same seed gives
the same tokens whatever else shares the batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from shoal.sampling_params import SamplingParams


class Sampler:
    """Samples one token per row of a logits matrix."""

    @torch.inference_mode()
    def __call__(
        self,
        logits: torch.Tensor | None,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        argmax: torch.Tensor | None = None,
        histories: Sequence[tuple[Sequence[int], int]] | None = None,
    ) -> tuple[list[int], list[float | None]]:
        """Pick the next token of each row.

        Args:
            logits: `[num_rows, vocab_size]` float32; None when every row is greedy, wants no
                logprobs and `argmax` is given.
            params: each row's sampling parameters.
            generators: each row's random stream (None for greedy rows).
            argmax: `[num_rows]` int64, each row's argmax when the caller has it already (a full
                argmax over a 49,152-wide row costs about 70 µs here).
            histories: each row's token ids (prompt, then output) and its prompt length in
                tokens; read only for rows with a penalty (`SamplingParams.penalized`).

        Returns:
            The sampled token id per row, and its log-probability under the model's (unscaled,
            unpenalized) distribution for rows that asked for `logprobs`, else None.

        Raises:
            ValueError: `logits` is None where a row needs them, or `histories` where a row has
                a penalty.
        """
        if logits is None and (argmax is None or self.needs_logits(params)):
            raise ValueError("the logits are needed: a row samples, wants logprobs or has a penalty")
        chosen = logits  # what the tokens are picked from; logprobs stay the model's
        if any(p.penalized for p in params):
            if histories is None:
                raise ValueError("a row has a penalty: its token history is needed")
            # Rows without a penalty pass an empty history: their logits come through as they are.
            chosen = apply_penalties(logits, params, [h if p.penalized else ((), 0)
                                                      for p, h in zip(params, histories)])
            argmax = None
        tokens = chosen.argmax(dim=-1) if argmax is None else argmax.clone()
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if sampled_rows:
            idx = torch.tensor(sampled_rows)
            tokens[idx] = self._sample(chosen[idx], [params[i] for i in sampled_rows],
                                       [generators[i] for i in sampled_rows])
        token_list = tokens.tolist()
        logprobs: list[float | None] = [None] * len(params)
        want = [i for i, p in enumerate(params) if p.logprobs]
        if want:
            rows = logits[want]
            lp = rows.gather(1, tokens[want].unsqueeze(1)).squeeze(1) - torch.logsumexp(rows, dim=-1)
            for i, value in zip(want, lp.tolist()):
                logprobs[i] = value
        return token_list, logprobs

    @staticmethod
    def needs_logits(params: list[SamplingParams]) -> bool:
        """Whether rows with these parameters read their logits, not only their argmax: a row
        that samples, wants logprobs or has a penalty."""
        return any(not p.greedy or p.logprobs or p.penalized for p in params)

    def _sample(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32).unsqueeze(1)
        logits = logits / temps
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            logits = self._top_k_top_p(logits, params)
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs)
        for row, g in enumerate(generators):
            noise[row].exponential_(generator=g)
        return probs.div_(noise).argmax(dim=-1)

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Set logits outside each row's top-k and top-p set to -inf (`[rows, vocab]` float32)."""
        vocab = logits.shape[-1]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ks = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params]).unsqueeze(1)
        ranks = torch.arange(vocab).unsqueeze(0)
        drop = ranks >= ks
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32).unsqueeze(1)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the first always stays.
        drop |= (probs.cumsum(dim=-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams],
                    histories: Sequence[tuple[Sequence[int], int]]) -> torch.Tensor:
    """Each row's logits with its penalties on the tokens it has seen, as vLLM applies them.

    For a token t of row r, with c the times the output holds t: where the prompt or the output
    holds t, a positive logit is divided by `repetition_penalty` and any other multiplied by it
    (CTRL, Keskar et al. 2019, §4.1); then `frequency_penalty * c` and, where c > 0,
    `presence_penalty` are subtracted (OpenAI's API).

    Args:
        logits: `[rows, vocab]` float32; not changed.
        params: each row's sampling parameters.
        histories: each row's token ids (prompt, then output) and its prompt length in tokens.

    Returns:
        `[rows, vocab]` float32, a new tensor.
    """
    vocab = logits.shape[1]
    # Only the (row, token) pairs a history holds are touched: keys row * vocab + token into
    # the flat logits. (Dense [rows, vocab] counts and masks cost 37-46 ms at 64 rows of 200
    # tokens on 2 cores, about half a decode step; this costs under 2.)
    out = logits.clone()
    flat = out.view(-1)
    rows, tokens = _flat([ids[n:] for ids, n in histories])
    out_keys, counts = torch.unique(rows * vocab + tokens, return_counts=True)
    rows, tokens = _flat([ids[:n] for ids, n in histories])
    seen = torch.unique(torch.cat([rows * vocab + tokens, out_keys]))

    def per_key(name: str, keys: torch.Tensor) -> torch.Tensor:
        """Each key's row's value of the parameter `name`, `[len(keys)]` float32."""
        return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32)[keys // vocab]

    x, penalty = flat[seen], per_key("repetition_penalty", seen)
    flat[seen] = torch.where(x > 0, x / penalty, x * penalty)
    flat[out_keys] -= (per_key("frequency_penalty", out_keys) * counts
                       + per_key("presence_penalty", out_keys))
    return out


def _flat(spans: list[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The row index and the token id of every token of every row's span, `[total]` int64 each."""
    index = torch.repeat_interleave(torch.arange(len(spans)), torch.tensor([len(x) for x in spans]))
    return index, torch.tensor(list(itertools.chain.from_iterable(spans)), dtype=torch.long)
