"""Masks that keep each constrained request's next token within its structured output.

Each request with a `structured_output` holds an llguidance matcher: the state of its
constraint after the tokens it has generated. Before a row samples, the matcher gives the set of
tokens that can continue the text toward a match (a bitmask, one bit a vocabulary entry),
computed while the forward pass runs (`prepare`), and the row's other logits become -inf
(`apply`); the sampled token then advances the matcher. When the
constraint is complete and nothing can follow (`is_stopped`), the request finishes, as it would
at its end-of-sequence token, the only token the mask would allow next. A request whose
constraint starts after given tokens (a reasoning model's end of thinking) gets its matcher
once its output holds them (`constrained_from`).

The tokenizer llguidance reads (every token's bytes) is built from the model's `tokenizer.json`
once per worker, in a background thread started with the engine, so neither start-up nor the
first constrained request waits for it in the common case.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from shoal.structured_output import InvalidStructuredOutput, StructuredOutput
from worker import ops


class GrammarMasks:
    """Compiles constraints against the model's tokenizer and masks logits rows with them.

    Args:
        model_path: the model (GGUF file or Hugging Face directory) whose tokenizer the
            constraints are compiled against; None serves no constraint (random-weight engines
            of tests).
        vocab_size: the model's vocabulary, in tokens (the logits' width).
        eos_token_id: the token that ends a complete constraint.
        kernels: mask through the C++ kernel (the model's own choice, `LlamaModel.kernels`:
            a GPU worker never builds the CPU kernels for this).
    """

    def __init__(self, model_path: Path | None, vocab_size: int, eos_token_id: int | None,
                 kernels: bool = False) -> None:
        self.vocab_size = vocab_size
        self.kernels = kernels
        self._tokenizer = None
        self._error: Exception | None = None
        self._ready = threading.Event()
        self._executor = None
        self._pool: ThreadPoolExecutor | None = None
        # Rows masked, and the seconds iterations spent waiting for and applying masks.
        self.rows = 0
        self.seconds = 0.0
        if model_path is None:
            self._error = InvalidStructuredOutput("this engine has no tokenizer to compile "
                                                  "structured outputs against")
            self._ready.set()
        else:
            threading.Thread(target=self._load, args=(model_path, eos_token_id), daemon=True,
                             name="grammar-tokenizer").start()

    def _load(self, model_path: Path, eos_token_id: int | None) -> None:
        try:
            import llguidance

            from shoal.model_files import tokenizer_json

            self._tokenizer = llguidance.LLTokenizer(tokenizer_json(model_path),
                                                     n_vocab=self.vocab_size,
                                                     eos_token=eos_token_id)
            self._executor = llguidance.LLExecutor()
        except Exception as e:  # reported to each constrained request, never to the others
            self._error = e
        finally:
            self._ready.set()

    def matcher(self, constraint: StructuredOutput, output_token_ids: Sequence[int]):
        """A new llguidance `LLMatcher` for `constraint`, advanced past the tokens a resumed
        request generated already (preempted or moved from a lost worker).

        Raises:
            InvalidStructuredOutput: the constraint does not compile, the tokenizer could not be
                built, or the tokens so far break the constraint.
        """
        import llguidance

        self._ready.wait()
        if self._tokenizer is None:
            raise InvalidStructuredOutput(f"structured outputs are unavailable: {self._error}")
        m = llguidance.LLMatcher(self._tokenizer, constraint.grammar())
        if m.is_error():
            raise InvalidStructuredOutput(f"structured output: {m.get_error()}")
        if output_token_ids and not m.consume_tokens(list(output_token_ids)):
            raise InvalidStructuredOutput(f"structured output: the tokens generated so far do not "
                                          f"match it ({m.get_error()})")
        return m

    def prepare(self, matchers: Sequence) -> PendingMasks | None:
        """Start computing the masks of the rows that have a matcher, on a thread of their own
        (llguidance releases the GIL), so that they are built while the forward pass runs: the
        masks follow from the tokens so far, not from this iteration's logits. Until `wait`
        returns, those matchers are the thread's: a call on one of them raises (llguidance
        lends a matcher to one caller at a time).

        Args:
            matchers: each sampling row's `LLMatcher`, or None for an unconstrained row.

        Returns:
            The masks being computed, for `apply`; None when no row is constrained.
        """
        rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        import llguidance.torch

        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        bitmask = torch.empty(len(rows), -(-self.vocab_size // 32), dtype=torch.int32)
        # Rows of several requests are filled on llguidance's own thread pool.
        done = self._pool.submit(llguidance.torch.fill_next_token_bitmask_par, self._executor,
                                 [(m, k) for k, (m, _) in enumerate(rows)], bitmask)
        return PendingMasks(torch.tensor([i for _, i in rows]), bitmask, done)

    def wait(self, pending: PendingMasks | None) -> None:
        """Return once the masks `prepare` started are built."""
        if pending is not None:
            t0 = time.perf_counter()
            pending.done.result()
            self.seconds += time.perf_counter() - t0

    @torch.inference_mode()  # the logits may be an inference tensor: written in place
    def apply(self, logits: torch.Tensor, pending: PendingMasks | None) -> bool:
        """Set every logit a row's constraint does not allow next to -inf, in place, once the
        masks `prepare` started are ready.

        Args:
            logits: `[rows, vocab_size]` float32 on the CPU, in the rows `prepare` was given.
            pending: what `prepare` returned.

        Returns:
            Whether any row was constrained.
        """
        if pending is None:
            return False
        self.wait(pending)
        t0 = time.perf_counter()
        ops.apply_token_bitmask_(logits, pending.bitmask, pending.rows,
                                 self.kernels and logits.is_contiguous())
        self.rows += len(pending.rows)
        self.seconds += time.perf_counter() - t0
        return True


@dataclass
class PendingMasks:
    """Masks being computed (`GrammarMasks.prepare`).

    Attributes:
        rows: `[n]` int64, the sampling rows they mask.
        bitmask: `[n, ceil(vocab_size / 32)]` int32, llguidance's layout (token 32 * w + j is
            bit j of word w), filled when `done` is.
        done: the computation.
    """

    rows: torch.Tensor
    bitmask: torch.Tensor
    done: Future


def constrained_from(output_token_ids: Sequence[int], after: Sequence[int]) -> int | None:
    """Where a request's constrained output begins (`SamplingParams.structured_output_after`):
    0 without `after`; else just past the first place the output holds `after`; None while it
    does not yet (a reasoning model still thinking)."""
    n = len(after)
    if not n:
        return 0
    after = list(after)
    for end in range(n, len(output_token_ids) + 1):
        if list(output_token_ids[end - n:end]) == after:
            return end
    return None


def advance(matcher, token: int) -> bool:
    """Feed a sampled `token` to a request's matcher. Returns True when the constraint is
    complete and nothing may follow (the request stops).

    Raises:
        InvalidStructuredOutput: the token breaks the constraint (a mask was not applied).
    """
    if not matcher.consume_token(token):
        raise InvalidStructuredOutput(f"structured output: token {token} does not match it "
                                      f"({matcher.get_error()})")
    return matcher.is_stopped()
