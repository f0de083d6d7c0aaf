"""Reasoning outputs, as vLLM's `--reasoning-parser`: a reasoning model writes its thinking
between `<think>` and `</think>`, then its answer; the gateway hands the two on apart, the
thinking as chat's `reasoning` (and `reasoning_content`, its older name, which DeepSeek's API
and many clients read), a `reasoning` output item of the Responses API, a `thinking` block of
the Messages API, and only the answer as `content` (where tool calls are read from).

Parsers (`REASONING_PARSERS`): `deepseek_r1` (DeepSeek R1, QwQ: the template opens `<think>`
in the prompt, so the reply may hold only the end tag) and `qwen3` (Qwen3: the same, but a
request whose `chat_template_kwargs` set `enable_thinking: false` asks the model not to think,
so its reply is all content). A reply whose thinking has not ended (no `</think>`: cut short
by max_tokens, or a model that does not think) is all reasoning. The tags are text, so the
split works on the detokenized reply, streamed or not.

A constraint (structured outputs, tool calls made by them) holds from the end of the thinking,
as vLLM applies it with a reasoning parser: the request carries the token ids of `</think>`
(`SamplingParams.structured_output_after`), and the worker starts the constraint once the
output holds them. In a reasoning model's vocabulary `</think>` is one token; a model whose
tokenizer splits it is constrained only if it writes the tag in the tokens `encode` gives it
alone (SmolLM2 does, when a newline follows the tag).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

START, END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")


class Piece(str):
    """The new text of one token event, as `Gateway.run` yields it, knowing where each of the
    event's tokens' text ends in it (`token_ends`, characters, one a token, rising; text a stop
    string held back counts to the token that let it go). An event holds several tokens at
    `--stream-interval` > 1, and the thinking may end at any of them."""

    token_ends: tuple[int, ...]

    @classmethod
    def of(cls, text: str, token_ends: Sequence[int]) -> Piece:
        piece = cls(text)
        piece.token_ends = tuple(token_ends)
        if piece.token_ends:  # text let go after the last token (a flush) is that token's
            piece.token_ends = (*piece.token_ends[:-1], len(text))
        return piece


def _could_begin(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag` (a stream holds them)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class Reasoning:
    """How the replies of one chat request split into reasoning and content, streamed (one
    reader a choice) or whole (`split`).

    Attributes:
        parser: one of `REASONING_PARSERS`.
    """

    parser: str
    _readers: dict[int, _Reader] = field(default_factory=dict)

    @classmethod
    def of(cls, parser: str | None, chat_template_kwargs: dict[str, Any] | None
           ) -> Reasoning | None:
        """The request's reasoning, or None when its reply is all content (no parser, or
        `qwen3` asked not to think)."""
        if parser is None or parser == "qwen3" and (chat_template_kwargs or {}).get(
                "enable_thinking", True) is False:
            return None
        return cls(parser)

    @staticmethod
    def split(text: str) -> tuple[str | None, str | None]:
        """A finished reply as (reasoning, content), None for a part that is empty: the text
        up to `</think>` (a leading `<think>` left out) and the text after it; a reply without
        the end tag is all reasoning."""
        body = text.lstrip()
        body = body[len(START):] if body.startswith(START) else text
        reasoning, ended, content = body.partition(END)
        return reasoning or None, (content or None) if ended else None

    def feed(self, choice: int, piece: str, finished: bool, tokens: int = 0) -> tuple[str, str]:
        """A choice's next text `piece` (of `tokens` tokens; a `Piece` tells its own) as
        (reasoning, content) to send: reasoning until `</think>`, content after it; what could
        still begin a tag is held back until the next piece tells, or the choice finishes.
        Joined, the pieces are `split`'s parts."""
        ends = piece.token_ends if isinstance(piece, Piece) else None
        return self._readers.setdefault(choice, _Reader()).feed(
            piece, finished, len(ends) if ends is not None else tokens, ends)

    def thinking_tokens(self, choice: int) -> int:
        """How many of a choice's tokens so far were thinking (usage's `reasoning_tokens`):
        every token before the answer began, the one whose text completes `</think>`
        included. Where a piece of several tokens is a plain `str`, not a `Piece`, all of the
        piece that ends the thinking counts."""
        reader = self._readers.get(choice)
        return reader.thinking_tokens if reader is not None else 0


@dataclass
class _Reader:
    """One streamed reply: its text so far and how much of each part has been sent."""

    text: str = ""
    reasoning_sent: int = 0
    content_from: int | None = None  # where the content begins in `text`, once `</think>` has
    thinking_tokens: int = 0  # tokens fed before the content began

    def feed(self, piece: str, finished: bool, tokens: int,
             ends: tuple[int, ...] | None = None) -> tuple[str, str]:
        self.text += piece
        if self.content_from is not None:
            return "", piece
        stripped = self.text.lstrip()
        if not finished and START.startswith(stripped) and stripped != START:
            self.thinking_tokens += tokens
            return "", ""  # blank, or what could still be the opening tag
        begin = len(self.text) - len(stripped) + len(START) if stripped.startswith(START) else 0
        end = self.text.find(END, begin)
        if end >= 0:
            self.content_from = end + len(END)
            # Of this piece, the tokens up to the one whose text completes the tag.
            reach = self.content_from - (len(self.text) - len(piece))
            tokens = next((i + 1 for i, e in enumerate(ends or ()) if e >= reach), tokens)
            reasoning, content = self.text[begin:end], self.text[self.content_from:]
        else:
            held = 0 if finished else _could_begin(self.text, END)
            reasoning, content = self.text[begin:len(self.text) - held], ""
        self.thinking_tokens += tokens
        out = reasoning[self.reasoning_sent:]
        self.reasoning_sent = max(self.reasoning_sent, len(reasoning))
        return out, content
