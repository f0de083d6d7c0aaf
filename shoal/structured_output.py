"""Structured outputs: a constraint that a request's generated text must match.

A leaf module shared by the gateway, which builds and checks a constraint from an API request
(OpenAI's `response_format`, vLLM's `structured_outputs`), the scheduler, which forwards it, and
the worker, which masks each sampled row's logits to the tokens the constraint still allows
(`worker.structured_output`). Constraints are compiled by llguidance (Microsoft's Rust
implementation of constrained decoding: an Earley parser over a lazily built lexer, masks in tens
of microseconds), the library vLLM serves as its `guidance` backend; it is imported only where a
constraint is checked or compiled, never by the scheduler.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

# The forms a constraint takes, and what its `spec` holds for each.
STRUCTURED_OUTPUT_KINDS = {
    "json": "a JSON Schema, as JSON text",
    "regex": "a regular expression (Rust's regex syntax) the whole output matches",
    "choice": "a JSON list of strings, one of which is the whole output",
    "grammar": "a context-free grammar in Lark's syntax (llguidance's dialect)",
}


class InvalidStructuredOutput(ValueError):
    """A constraint that cannot be compiled; the message says why."""


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output text.

    Attributes:
        kind: one of `STRUCTURED_OUTPUT_KINDS`.
        spec: the constraint itself, as that kind reads it (text, so that it crosses the wire
            as it came).

    Raises:
        InvalidStructuredOutput: an unknown kind (the spec is checked by `check`).
    """

    kind: str
    spec: str

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_OUTPUT_KINDS:
            raise InvalidStructuredOutput(f"structured output kind must be one of "
                                          f"{', '.join(STRUCTURED_OUTPUT_KINDS)}, got {self.kind!r}")

    def grammar(self) -> str:
        """The constraint as an llguidance grammar (its JSON text).

        Raises:
            InvalidStructuredOutput: a JSON schema or a choice list that is not valid JSON of
                its form.
        """
        from llguidance import LLMatcher

        if self.kind == "json":
            return LLMatcher.grammar_from_json_schema(_load(self.spec, dict, "a JSON Schema object"))
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "choice":
            choices = _load(self.spec, list, "a list of strings")
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise InvalidStructuredOutput("choice must be a non-empty list of non-empty strings")
            # Lark's string literals take JSON's escapes.
            return LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, choices)))
        return LLMatcher.grammar_from_lark(self.spec)

    def check(self) -> None:
        """Compile the constraint without a tokenizer, to refuse a bad one before it is queued.

        Raises:
            InvalidStructuredOutput: it does not compile; the message is llguidance's.
        """
        error = _grammar_error(self.kind, self.spec)
        if error:
            raise InvalidStructuredOutput(error)


# A JSON Schema that every JSON object satisfies: OpenAI's `response_format` "json_object".
JSON_OBJECT = StructuredOutput("json", '{"type": "object"}')


def _load(spec: str, form: type, what: str):
    try:
        value = json.loads(spec)
    except ValueError as e:
        raise InvalidStructuredOutput(f"{what} is needed, got text that is not JSON: {e}") from e
    if not isinstance(value, form):
        raise InvalidStructuredOutput(f"{what} is needed, got {type(value).__name__}")
    return value


@functools.lru_cache(maxsize=256)  # batches and retries send the same constraint many times
def _grammar_error(kind: str, spec: str) -> str:
    """llguidance's complaint about a constraint, or "" when it compiles."""
    from llguidance import LLMatcher

    try:
        grammar = StructuredOutput(kind, spec).grammar()
    except InvalidStructuredOutput as e:
        return str(e)
    return LLMatcher.validate_grammar(grammar)  # (llguidance's grammar_from_* never raise)
