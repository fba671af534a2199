"""``rlvr.tokens``: the backend's batched encode and decode give what the tokenizer's own calls give, and
settings the backend would apply differently send the call back to the tokenizer."""

from __future__ import annotations

import random

import pytest

from rlvr.tokens import decode_texts, encode_texts

TEXTS = [
    "Janet has 3 apples. <think>2 + 2 = 4</think> <answer>4</answer>",
    "",
    "  leading spaces and a tab\tand a newline\n",
    "ünïcödé — and 数字 12,345",
    "<|endoftext|> a special token in the text",
]


def test_encode_equals_the_tokenizer_call(tiny_tokenizer):
    assert encode_texts(tiny_tokenizer, TEXTS) == tiny_tokenizer(TEXTS, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("skip", [True, False])
def test_decode_equals_batch_decode(tiny_tokenizer, skip):
    rng = random.Random(0)
    special = tiny_tokenizer.all_special_ids
    seqs = [[rng.randrange(len(tiny_tokenizer)) for _ in range(n)] for n in (0, 1, 17, 64)]
    seqs += [[special[0], *seqs[2], special[-1]]] + tiny_tokenizer(TEXTS, add_special_tokens=False)["input_ids"]
    assert decode_texts(tiny_tokenizer, seqs, skip) == tiny_tokenizer.batch_decode(seqs, skip_special_tokens=skip)
    assert any(tiny_tokenizer.decode([i]) in decode_texts(tiny_tokenizer, [seqs[4]], False)[0] for i in special)


def test_settings_the_backend_would_apply_go_through_the_tokenizer(tiny_tokenizer, monkeypatch):
    """Truncation configured on the backend (the tokenizer's call turns it off) and clean-up of
    tokenization spaces (done in Python) take the tokenizer's path."""
    full = tiny_tokenizer(TEXTS[:1], add_special_tokens=False)["input_ids"]
    assert len(full[0]) > 3
    tiny_tokenizer.backend_tokenizer.enable_truncation(max_length=3)
    assert len(tiny_tokenizer.backend_tokenizer.encode_batch(TEXTS[:1], add_special_tokens=False)[0].ids) == 3
    assert encode_texts(tiny_tokenizer, TEXTS[:1]) == full
    calls = []
    original = type(tiny_tokenizer).batch_decode
    monkeypatch.setattr(
        type(tiny_tokenizer), "batch_decode", lambda self, *a, **k: calls.append(1) or original(self, *a, **k)
    )
    decode_texts(tiny_tokenizer, full)
    assert not calls
    monkeypatch.setattr(tiny_tokenizer, "clean_up_tokenization_spaces", True)
    decode_texts(tiny_tokenizer, full)
    assert calls == [1]
