"""Incremental detokenization that never emits a broken UTF-8 sequence.

Byte-level BPE splits multi-byte characters across tokens; decoding a lone token then yields the
replacement character U+FFFD. Following the prefix/read-offset scheme of TGI and vLLM, each new
token is decoded together with a few tokens before it, and text is released only once it no longer
ends in U+FFFD; the context tokens keep merges and leading spaces right.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces.

    Args:
        tokenizer: a `transformers` tokenizer (its `decode` is used).
        skip_special_tokens: leave out special tokens such as `<|im_end|>`.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = []
        self.prefix_offset = 0  # start of the context window decoded with new tokens
        self.read_offset = 0  # tokens before this are already emitted as text
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Add one token; return the text that became final (possibly empty)."""
        self.tokens.append(token_id)
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            piece = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            self.text += piece
            return piece
        return ""

    def flush(self) -> str:
        """At the end of the stream: whatever is still held back (it may hold U+FFFD)."""
        full = self._decode(self.tokens[self.prefix_offset :])
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        piece = full[len(prefix) :]
        self.read_offset = len(self.tokens)
        self.prefix_offset = self.read_offset
        self.text += piece
        return piece
