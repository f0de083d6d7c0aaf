"""Sampling the next token of every request in the batch at once.

A request's logit bias and its penalties on tokens it has seen come first (bias, repetition,
then frequency and presence, in vLLM's order). Greedy rows take the argmax. Other rows are
scaled by temperature, cut to their min-p, top-k and top-p sets, and sampled by inverse
transform: one
uniform draw `u` from the request's own `torch.Generator` picks the first token whose cumulative
probability reaches `u`. A request
draws exactly one number per sampled token, so its tokens depend only on its seed and how many
it has sampled: the same seed gives the same tokens whatever else shares the batch, and a
request resumed elsewhere with its output so far (`skip_draws`) goes on as if never moved.

Cost of sampling 64 rows of SmolLM2's 49,152 logits on a 2-core Zen 4 (session 18): the former
exponential race (Gumbel-max: a noise draw per vocabulary entry, 61 ms of draws) took 66-75 ms at
temperature 1, and top-k or top-p through a full sort 190-220 ms, more than a decode step of the
model; then 4.4-7 ms in torch (softmax over whole rows, topk, cumsum), and 1.3 ms at temperature
alone, 2.5 ms with top-k or top-p, through the C++ kernels (session 33: `shoal::sample_rows`
samples a whole row in one pass; top-k and top-p rows take their candidates from the logits'
top c and each row's log-normalizer, never writing a softmax). Only a row whose nucleus holds
thousands of tokens (near-flat logits) still ends in a full sort (170-200 ms for 64 such rows).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import torch

from shoal.sampling_params import SamplingParams


class Sampler:
    """Samples one token per row of a logits matrix.

    Args:
        kernels: sample through the C++ kernels rather than torch's softmax, cumsum and
            searchsorted: rows without top-k or top-p in one pass each (`shoal::sample_rows`),
            top-k and top-p rows from their candidates (`_candidates`); the same rule, rounding
            aside.
    """

    def __init__(self, kernels: bool = False) -> None:
        self.kernels = kernels

    @torch.inference_mode()
    def __call__(
        self,
        logits: torch.Tensor | None,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        argmax: torch.Tensor | None = None,
        histories: Sequence[tuple[Sequence[int], int]] | None = None,
    ) -> tuple[list[int], list[float | None], list[list[list] | None]]:
        """Pick the next token of each row.

        Args:
            logits: `[num_rows, vocab_size]` float32; None when every row is greedy, wants no
                logprobs and `argmax` is given.
            params: each row's sampling parameters.
            generators: each row's random stream (None for greedy rows).
            argmax: `[num_rows]` int64, each row's argmax when the caller has it already (a full
                argmax over a 49,152-wide row costs about 70 µs here).
            histories: each row's token ids (prompt, then output) and its prompt length in
                tokens; read only for rows with a penalty.

        Returns:
            The sampled token id per row; its log-probability under the model's (unscaled,
            unbiased, unpenalized) distribution for rows that asked for `logprobs`, else None;
            and for rows that asked for `top_logprobs` k, the k most likely tokens under that
            distribution as `[token id, logprob]` pairs, most likely first (else None).

        Raises:
            ValueError: `logits` is None where a row needs them, or `histories` where a row has
                a logit bias or a penalty.
        """
        if logits is None and (argmax is None or self.needs_logits(params)):
            raise ValueError("the logits are needed: a row samples, wants logprobs or has a penalty")
        chosen = logits  # what the tokens are picked from; logprobs stay the model's
        if any(p.adjusts_logits for p in params):
            if histories is None:
                raise ValueError("a row has a logit bias or a penalty: its token history is needed")
            # Rows without a penalty pass an empty history: their logits come through as they are.
            chosen = adjust_logits(logits, params, [h if p.adjusts_logits else ((), 0)
                                                    for p, h in zip(params, histories)])
            argmax = None
        tokens = chosen.argmax(dim=-1) if argmax is None else argmax.clone()
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if sampled_rows:
            idx = torch.tensor(sampled_rows)
            rows, sampled = chosen[idx], [params[i] for i in sampled_rows]  # rows: a copy
            _apply_min_p(rows, sampled)
            tokens[idx] = self._sample(rows, sampled, [generators[i] for i in sampled_rows])
        token_list = tokens.tolist()
        logprobs: list[float | None] = [None] * len(params)
        tops: list[list[list] | None] = [None] * len(params)
        want = [i for i, p in enumerate(params) if p.logprobs]
        if want:
            rows = logits[want].log_softmax(dim=-1)
            lp = rows.gather(1, tokens[want].unsqueeze(1)).squeeze(1)
            for i, value in zip(want, lp.tolist()):
                logprobs[i] = value
            k = max(params[i].top_logprobs for i in want)
            if k:
                values, ids = rows.topk(k, dim=-1)  # one call for every row, cut to each row's k
                for (i, v, t) in zip(want, values.tolist(), ids.tolist()):
                    n = params[i].top_logprobs
                    if n:
                        tops[i] = [[tok, val] for tok, val in zip(t[:n], v[:n])]
        return token_list, logprobs, tops

    @staticmethod
    def needs_logits(params: list[SamplingParams]) -> bool:
        """Whether rows with these parameters read their logits, not only their argmax: a row
        that samples, wants logprobs, or has a logit bias or a penalty."""
        return any(not p.greedy or p.logprobs or p.adjusts_logits for p in params)

    def _sample(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        """`[rows]` int64 tokens drawn from `logits` `[rows, vocab]` float32, each row under its
        temperature, top-k and top-p, with one uniform draw from its generator."""
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        u = torch.cat([draw(g) for g in generators])
        tokens = torch.empty(len(params), dtype=torch.long)
        cut = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
        whole = [i for i, p in enumerate(params) if not (p.top_k > 0 or p.top_p < 1.0)]
        if whole and self.kernels:
            rows = logits if len(whole) == len(params) else logits[whole]
            tokens[whole] = torch.ops.shoal.sample_rows(rows.contiguous(), temps[whole], u[whole])
        elif whole:
            probs = torch.softmax(logits[whole] / temps[whole].unsqueeze(1), dim=-1)
            tokens[whole] = _inverse_transform(probs, u[whole])
        if cut:
            rows = logits if len(cut) == len(params) else logits[cut]
            tokens[cut] = _sample_top_k_top_p(_candidates(rows.contiguous(), temps[cut],
                                                          self.kernels),
                                              rows.shape[1], [params[i] for i in cut], u[cut])
        return tokens


def draw(generator: torch.Generator | None) -> torch.Tensor:
    """The one uniform number in [0, 1) a sampled token takes from its request's stream, `[1]`."""
    return torch.rand(1, generator=generator)


def skip_draws(generator: torch.Generator, num_tokens: int) -> None:
    """Advance `generator` past the draws of `num_tokens` tokens already sampled (a request
    resumed with its output so far)."""
    for _ in range(num_tokens):
        draw(generator)


def _inverse_transform(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """For each row of `weights` `[rows, n]` (non-negative, not all zero), the first index whose
    cumulative weight reaches `u` `[rows]` (in [0, 1)) times the row's total: index i with
    probability weights[i] / total. `[rows]` int64.

    Never an index of zero weight: the target is at least the smallest positive float, and at
    most the total (where u * total rounds up to it, the last index of positive weight). A row
    that breaks the precondition (NaN weights) still gets an index in range, its last."""
    cdf = weights.cumsum(dim=-1)
    target = (u * cdf[:, -1]).clamp_(min=torch.finfo(cdf.dtype).tiny).unsqueeze(1)
    return torch.searchsorted(cdf, target).squeeze(1).clamp_(max=weights.shape[1] - 1)


# Candidates a top-p row starts from (its top-k when larger); widened 8-fold while its nucleus
# reaches past them. Past a quarter of the vocabulary a full sort is as cheap.
TOP_P_CANDIDATES = 64


Candidates = Callable[[list[int], int], tuple[torch.Tensor, torch.Tensor]]


def _candidates(logits: torch.Tensor, temps: torch.Tensor, kernels: bool) -> Candidates:
    """For rows of `logits` `[rows, vocab]` float32 at temperatures `temps` `[rows]`: a function
    of (row indices, c) giving those rows' c most likely tokens, most likely first, as their
    probabilities `[n, c]` float32 and token ids `[n, c]` int64. With the kernels, from the
    logits' top c (`shoal::topk_rows`) and each row's log-normalizer (`shoal::log_normalizers`)
    below a quarter of the vocabulary; else (and past it) from the softmax over whole rows."""
    vocab = logits.shape[1]
    lse = torch.ops.shoal.log_normalizers(logits, temps) if kernels else None
    probs: list[torch.Tensor | None] = [None]

    def top(rows: list[int], c: int) -> tuple[torch.Tensor, torch.Tensor]:
        if lse is not None and 4 * c <= vocab:
            part = logits if len(rows) == len(logits) else logits[rows]  # (rows in order)
            values, index = torch.ops.shoal.topk_rows(part.contiguous(), c)
            return torch.exp(values / temps[rows, None] - lse[rows, None]), index
        if probs[0] is None:
            probs[0] = torch.softmax(logits / temps.unsqueeze(1), dim=-1)
        return probs[0][rows].topk(c, dim=-1)
    return top


def _sample_top_k_top_p(candidates: Candidates, vocab: int, params: list[SamplingParams],
                        u: torch.Tensor) -> torch.Tensor:
    """Sample rows within each row's top-k set and, over that set's renormalized distribution,
    its top-p set (nucleus sampling, Holtzman et al. 2020: the most likely tokens until their
    mass reaches top_p; the first always stays), with `u` `[rows]` uniform in [0, 1). `[rows]`
    int64.

    A row's sets come from its `c` most likely tokens (`candidates`, sorted; `vocab` is the
    rows' width): at first its top-k or TOP_P_CANDIDATES, whichever is more, widened while a
    row without top-k has not closed its nucleus within them. Rows take their candidates in
    groups of equal `c`, and each row's `c` follows from its own parameters and probabilities
    alone: its token does not depend on what else shares the batch."""
    tokens = torch.empty(len(params), dtype=torch.long)
    width = [max(TOP_P_CANDIDATES, p.top_k) for p in params]
    pending = list(range(len(params)))
    while pending:
        widen = []
        for c in sorted({width[i] for i in pending}):
            rows = [i for i in pending if width[i] == c]
            c = vocab if 4 * c > vocab else c
            done, value = _top_k_top_p_within(*candidates(rows, c), vocab,
                                              [params[i] for i in rows], u[rows])
            tokens[[r for r, d in zip(rows, done) if d]] = value[done]
            widen += [r for r, d in zip(rows, done) if not d]
        for i in widen:
            width[i] *= 8
        pending = widen
    return tokens


def _top_k_top_p_within(values: torch.Tensor, index: torch.Tensor, vocab: int,
                        params: list[SamplingParams], u: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """`_sample_top_k_top_p` over each row's `c` most likely tokens (c at least every row's
    top-k): their probabilities `values` `[rows, c]` float32, most likely first, and ids `index`
    `[rows, c]` int64. Returns which rows are complete, `[rows]` bool (those whose top-k set
    lies within the candidates or whose nucleus closed before the last one), and their tokens,
    `[rows]` int64 (meaningless for the others)."""
    c = values.shape[1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params]).unsqueeze(1)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32).unsqueeze(1)
    values = values.masked_fill(torch.arange(c).unsqueeze(0) >= top_k, 0.0)
    # The top-k set's mass: known when it lies within the candidates; without top-k, all of the
    # distribution (1).
    mass = torch.where(top_k <= c, values.sum(dim=-1, keepdim=True), 1.0)
    drop = (values.cumsum(dim=-1) - values) / mass >= top_p  # the mass ranked above reaches top_p
    # The most likely token always stays: a top_p below float32's smallest positive value (the
    # API takes any top_p > 0) rounds to 0 here and would drop it too.
    drop[:, 0] = False
    done = (top_k <= c).squeeze(1) | drop[:, -1] | (c == vocab)
    choice = _inverse_transform(values.masked_fill(drop, 0.0), u)
    return done, index.gather(1, choice.unsqueeze(1)).squeeze(1)


def _apply_min_p(rows: torch.Tensor, params: list[SamplingParams]) -> None:
    """Min-p sampling (Nguyen et al. 2024, as vLLM applies it, after the penalties and before
    top-k and top-p): in place, set to -inf the logits of each row's tokens whose probability
    at the row's temperature T is below `min_p` times its most likely token's. In logits that
    is l < max(l) + T log(min_p), so the rows need not be normalized.

    Args:
        rows: `[rows, vocab]` float32 logits of sampled (not greedy) rows; changed in place.
        params: each row's sampling parameters.
    """
    cut = [i for i, p in enumerate(params) if p.min_p > 0]
    if not cut:
        return
    idx = torch.tensor(cut)
    sub = rows[idx]
    offset = torch.tensor([[params[i].temperature * math.log(params[i].min_p)] for i in cut],
                          dtype=sub.dtype)
    sub[sub < sub.max(dim=-1, keepdim=True).values + offset] = float("-inf")
    rows[idx] = sub


MAX_ADJUSTED_LOGIT = 1e30  # divided by any temperature the API takes, still finite in float32


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams],
                  histories: Sequence[tuple[Sequence[int], int]]) -> torch.Tensor:
    """Each row's logits with its logit bias and its penalties on the tokens it has seen, in
    vLLM's order.

    For a token t of row r, with c the times the output holds t: its `logit_bias` is added;
    where the prompt or the output holds t, a positive logit is then divided by
    `repetition_penalty` and any other multiplied by it (CTRL, Keskar et al. 2019, §4.1); then
    `frequency_penalty * c` and, where c > 0, `presence_penalty` are subtracted (OpenAI's API).

    Args:
        logits: `[rows, vocab]` float32; not changed.
        params: each row's sampling parameters.
        histories: each row's token ids (prompt, then output) and its prompt length in tokens.

    Returns:
        `[rows, vocab]` float32, a new tensor.

    Raises:
        IndexError: a logit bias names a token id outside the vocabulary.
    """
    vocab = logits.shape[1]
    # Only the (row, token) pairs a bias or a history names are touched: keys row * vocab +
    # token into the flat logits. (Dense [rows, vocab] counts and masks cost 37-46 ms at 64
    # rows of 200 tokens on 2 cores, about half a decode step; this about 3.)
    out = logits.clone()
    flat = out.view(-1)
    pairs = [(r, t, b) for r, p in enumerate(params) for t, b in p.logit_bias]
    if pairs:
        rows, tokens, bias = zip(*pairs)
        if max(tokens) >= vocab:
            raise IndexError(f"logit_bias: token id {max(tokens)} is outside the vocabulary of {vocab}")
        flat[torch.tensor(rows) * vocab + torch.tensor(tokens)] += torch.tensor(bias)
    rows, tokens = _flat([ids[n:] for ids, n in histories])
    out_keys, counts = torch.unique(rows * vocab + tokens, return_counts=True)
    rows, tokens = _flat([ids[:n] for ids, n in histories])
    seen = torch.unique(torch.cat([rows * vocab + tokens, out_keys]))

    def per_key(name: str, keys: torch.Tensor) -> torch.Tensor:
        """Each key's row's value of the parameter `name`, `[len(keys)]` float32."""
        return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32)[keys // vocab]

    x, penalty = flat[seen], per_key("repetition_penalty", seen)
    # A penalty near 0 (the API takes any positive one) divides a logit past float32's range:
    # capped, it still outweighs every other, and a sampled row's softmax stays a distribution.
    flat[seen] = torch.where(x > 0, x / penalty, x * penalty).clamp_(max=MAX_ADJUSTED_LOGIT)
    flat[out_keys] -= (per_key("frequency_penalty", out_keys) * counts
                       + per_key("presence_penalty", out_keys))
    return out


def _flat(spans: list[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The row index and the token id of every token of every row's span, `[total]` int64 each."""
    index = torch.repeat_interleave(torch.arange(len(spans)), torch.tensor([len(x) for x in spans]))
    return index, torch.tensor(list(itertools.chain.from_iterable(spans)), dtype=torch.long)
