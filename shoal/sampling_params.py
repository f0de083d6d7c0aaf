"""Sampling parameters of one request.

Shared by every part: the gateway builds them from an API request, the scheduler forwards them and
the worker's sampler applies them. A leaf module: it imports nothing from gateway/, scheduler/ or
worker/.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from shoal.structured_output import InvalidStructuredOutput, StructuredOutput

CONTEXT_OVERFLOW = ("error", "reevaluate", "shift")
MAX_TOP_LOGPROBS = 20  # most alternatives reported per token (OpenAI's chat API caps it there)
# Temperatures below this are greedy, as vLLM's `_SAMPLING_EPS`: dividing logits by them
# overflows, and one below float32's smallest number (1.4e-45) reached the sampling kernels as 0.
SAMPLING_EPS = 1e-5


class InvalidSamplingParams(ValueError):
    """A sampling parameter is out of range; the message names the parameter."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    Attributes:
        max_tokens: most tokens to generate (>= 1).
        temperature: 0 (or anything below SAMPLING_EPS) means greedy (argmax); otherwise
            logits are divided by it.
        top_k: keep only the k most likely tokens; 0 or -1 disables.
        top_p: keep the smallest set of tokens whose probability reaches p (nucleus sampling,
            Holtzman et al. 2020); 1.0 disables.
        min_p: keep only the tokens whose probability (at the temperature) is at least
            `min_p` times the most likely one's (min-p sampling, Nguyen et al. 2024); 0
            disables.
        seed: seeds this request's own random stream, so its tokens do not depend on what else
            shares the batch. None draws a seed at random.
        stop_token_ids: token ids that end the request (the token is kept in the output).
        ignore_eos: keep generating past the model's end-of-sequence token (benchmarks).
        min_tokens: the end-of-sequence and stop tokens cannot end the request before this many
            tokens were generated.
        logprobs: report the log-probability of each sampled token.
        top_logprobs: with `logprobs`, also report this many most likely tokens at each
            step and their log-probabilities, in [0, MAX_TOP_LOGPROBS].
        prompt_logprobs: None, or report the log-probability of each prompt token after the
            first given the tokens before it (as vLLM's `prompt_logprobs`) and this many most
            likely tokens at each of those positions, in [0, MAX_TOP_LOGPROBS]. Such a request
            computes its whole prompt (no prefix-cache hits) and cannot overflow the window.
        presence_penalty: subtracted from the logit of every token the output already holds
            (OpenAI's API), in [-2, 2]; 0 disables.
        frequency_penalty: subtracted from a token's logit once per time the output holds it
            (OpenAI's API), in [-2, 2]; 0 disables.
        repetition_penalty: divides the positive logits and multiplies the negative ones of
            every token the prompt or the output holds (Keskar et al. 2019, CTRL, §4.1; as in
            transformers and vLLM), > 0; 1 disables, above 1 discourages repeats.
        logit_bias: (token id, bias) pairs: the bias, in [-100, 100], is added to the token's
            logit before the penalties (OpenAI's API; -100 in effect bans the token).
        context_overflow: what happens when the request's context fills the window: "error"
            (it finishes with finish_reason "length"), or it goes on past the window keeping
            the first `n_keep` tokens (attention sinks, StreamingLLM) and dropping the next
            `n_discard`: "reevaluate" recomputes the kept tokens' K/V at their new positions,
            "shift" rotates the cached keys back by `n_discard` positions (shift-RoPE-K).
        n_keep: tokens kept at the start of the context (>= 0).
        n_discard: tokens dropped after them each time the window fills; None means half of the
            window after the kept tokens.
        cache_salt: requests share cached prompt K/V (prefix caching) only with requests of
            the same salt (vLLM's `cache_salt`): a tenant's own salt keeps others from timing
            its prompts; None shares with every other unsalted request.
        allowed_token_ids: when given, the only token ids the request may sample (vLLM's
            `allowed_token_ids`); empty allows all.
        bad_words_token_ids: token id sequences the output may not hold (vLLM's `bad_words`,
            tokenized): a sequence's last token cannot be sampled where the output ends with
            the rest of it (a one-token sequence never).
        structured_output: None, or a constraint the generated text must match (JSON Schema,
            regular expression, choice, grammar; `shoal.structured_output`): every sampled
            token is one the constraint allows, and the request stops when it is complete.
        structured_output_after: token ids after which the constraint starts: the tokens up
            to where the output first ends with them are free (a reasoning model's thinking,
            up to its `</think>`; vLLM's structured outputs with a reasoning parser); empty:
            the constraint holds from the first token.
        lora_name: the LoRA adapter the request runs with (one its worker loaded with
            `--lora-modules`); None runs the base model.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    context_overflow: str = "error"
    n_keep: int = 4
    n_discard: int | None = None
    cache_salt: str | None = None
    allowed_token_ids: tuple[int, ...] = field(default_factory=tuple)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default_factory=tuple)
    structured_output: StructuredOutput | None = None
    structured_output_after: tuple[int, ...] = field(default_factory=tuple)
    lora_name: str | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidSamplingParams(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.temperature < math.inf:
            raise InvalidSamplingParams(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingParams(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidSamplingParams(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < -1:
            raise InvalidSamplingParams(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidSamplingParams(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidSamplingParams(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got "
                                        f"{self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise InvalidSamplingParams("top_logprobs needs logprobs")
        if self.prompt_logprobs is not None:
            if not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
                raise InvalidSamplingParams(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], "
                                            f"got {self.prompt_logprobs}")
            if self.context_overflow != "error":
                raise InvalidSamplingParams("prompt_logprobs needs context_overflow 'error'")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidSamplingParams(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise InvalidSamplingParams(f"repetition_penalty must be a positive number, got "
                                        f"{self.repetition_penalty}")
        if self.context_overflow not in CONTEXT_OVERFLOW:
            raise InvalidSamplingParams(f"context_overflow must be one of {', '.join(CONTEXT_OVERFLOW)}, "
                                        f"got {self.context_overflow!r}")
        if self.n_keep < 0:
            raise InvalidSamplingParams(f"n_keep must be >= 0, got {self.n_keep}")
        if self.n_discard is not None and self.n_discard < 1:
            raise InvalidSamplingParams(f"n_discard must be >= 1, got {self.n_discard}")
        if self.cache_salt is not None and not self.cache_salt:
            raise InvalidSamplingParams("cache_salt must be a non-empty string when given")
        if self.lora_name is not None and not self.lora_name:
            raise InvalidSamplingParams("lora_name must be a non-empty string when given")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "allowed_token_ids",
                           tuple(int(t) for t in self.allowed_token_ids))
        if any(t < 0 for t in self.allowed_token_ids):
            raise InvalidSamplingParams("allowed_token_ids must be token ids (>= 0)")
        bad = tuple(tuple(int(t) for t in word) for word in self.bad_words_token_ids)
        if any(not word or min(word) < 0 for word in bad):
            raise InvalidSamplingParams("bad_words_token_ids must be non-empty sequences of "
                                        "token ids (>= 0)")
        object.__setattr__(self, "bad_words_token_ids", bad)
        bias = tuple((int(t), float(b)) for t, b in self.logit_bias)
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in bias):
            raise InvalidSamplingParams("logit_bias maps token ids (>= 0) to biases in [-100, 100]")
        if len({t for t, _ in bias}) < len(bias):
            raise InvalidSamplingParams("logit_bias names a token id twice")
        object.__setattr__(self, "logit_bias", bias)
        object.__setattr__(self, "structured_output_after",
                           tuple(int(t) for t in self.structured_output_after))
        if any(t < 0 for t in self.structured_output_after):
            raise InvalidSamplingParams("structured_output_after must be token ids (>= 0)")
        if isinstance(self.structured_output, dict):  # from the wire (`to_dict`)
            try:
                object.__setattr__(self, "structured_output",
                                   StructuredOutput(**self.structured_output))
            except (TypeError, InvalidStructuredOutput) as e:
                raise InvalidSamplingParams(f"structured_output: {e}") from e

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def adjusts_logits(self) -> bool:
        """Whether a logit bias or a penalty (which reads the request's tokens) changes its
        logits before sampling."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["allowed_token_ids"] = list(self.allowed_token_ids)
        d["bad_words_token_ids"] = [list(word) for word in self.bad_words_token_ids]
        d["logit_bias"] = [list(pair) for pair in self.logit_bias]  # msgpack maps want str keys
        d["structured_output_after"] = list(self.structured_output_after)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Inverse of `to_dict`; fields this build does not know are ignored (as in
        `shoal.messages.Message.known_fields`)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
