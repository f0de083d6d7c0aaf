"""Incremental detokenization equals whole decoding and never emits a broken character."""

from __future__ import annotations

from shoal.detokenizer import IncrementalDetokenizer


def test_incremental_text_equals_full_decode(tokenizer):
    text = "Fish 🐟 swim in schools — 鱼群 and café crème; naïve: ok!  Spaces   kept.\nNew line"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 20
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(t) for t in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    # The emoji spans several byte tokens: some steps must have held text back.
    assert any(p == "" for p in pieces[:-1])


def test_special_tokens_are_skipped(tokenizer):
    ids = tokenizer.encode("Paris.", add_special_tokens=False) + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(detok.add(t) for t in ids) + detok.flush()
    assert text == "Paris."
