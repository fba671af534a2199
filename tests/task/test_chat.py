"""Conversations rendered with a chat template: token ids and the assistant-token mask (rlvr.task.chat)."""

from __future__ import annotations

import copy

import pytest
from conftest import chat_tokenizer

from rlvr.task.chat import (
    ChatFormatError,
    ChatTemplateError,
    check_messages,
    render,
    tokenize_chat,
    tokenize_prompt_completion,
)

CONVERSATION = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "Q"},
    {"role": "assistant", "content": "A"},
    {"role": "user", "content": "R"},
    {"role": "assistant", "content": "B"},
]


def ids(tok, tokens):
    return tok.convert_tokens_to_ids(tokens)


def test_the_mask_covers_each_assistant_turn_and_its_end_token(tiny_tokenizer):
    tok = chat_tokenizer(tiny_tokenizer)
    out = tokenize_chat(tok, CONVERSATION)
    assert (
        out.text
        == "<|system|>S<|end|><|user|>Q<|end|><|assistant|>A<|endoftext|><|user|>R<|end|><|assistant|>B<|endoftext|>"
    )
    tokens = ["<|system|>", "S", "<|end|>", "<|user|>", "Q", "<|end|>", "<|assistant|>", "A", "<|endoftext|>"]
    tokens += ["<|user|>", "R", "<|end|>", "<|assistant|>", "B", "<|endoftext|>"]
    assert out.input_ids == ids(tok, tokens)
    #                       sys S end usr Q end ast A  eos usr R end ast B  eos
    assert out.assistant_mask == [0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1]


def test_every_token_on_request_with_the_same_ids(tiny_tokenizer):
    tok = chat_tokenizer(tiny_tokenizer)
    only, every = tokenize_chat(tok, CONVERSATION), tokenize_chat(tok, CONVERSATION, assistant_only=False)
    assert every.input_ids == only.input_ids
    assert every.assistant_mask == [1] * 15


def test_the_tokens_before_a_turn_are_the_prompt_an_engine_generates_from(tiny_tokenizer):
    # A text template whose pieces BPE could merge across: cut at the boundaries, the prompt's tokens
    # are those of the rendered prompt encoded alone, and the masked tokens decode to the reply.
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    messages = [{"role": "user", "content": "How many apples?"}, {"role": "assistant", "content": "Twelve apples."}]
    out = tokenize_chat(tok, messages)
    prompt = tok("user: How many apples?\nassistant: ", add_special_tokens=False)["input_ids"]
    assert out.input_ids[: len(prompt)] == prompt
    assert out.assistant_mask == [0] * len(prompt) + [1] * (len(out.input_ids) - len(prompt))
    assert tok.decode(out.input_ids[len(prompt) :]) == "Twelve apples.\n"


def test_prompt_and_completion_split_where_the_generation_prompt_ends(tiny_tokenizer):
    tok = chat_tokenizer(tiny_tokenizer)
    prompt_ids, completion_ids = tokenize_prompt_completion(
        tok, CONVERSATION[:2], [{"role": "assistant", "content": "A"}]
    )
    assert prompt_ids == ids(tok, ["<|system|>", "S", "<|end|>", "<|user|>", "Q", "<|end|>", "<|assistant|>"])
    assert completion_ids == ids(tok, ["A", "<|endoftext|>"])
    assert render(tok, CONVERSATION[:2], add_generation_prompt=True).endswith("<|user|>Q<|end|><|assistant|>")


def test_a_conversation_that_opens_with_the_assistant(tiny_tokenizer):
    tok = chat_tokenizer(tiny_tokenizer)
    out = tokenize_chat(tok, [{"role": "assistant", "content": "A"}])
    assert out.input_ids == ids(tok, ["<|assistant|>", "A", "<|endoftext|>"])
    assert out.assistant_mask == [0, 1, 1]


def test_a_template_that_rewrites_earlier_turns_is_refused(tiny_tokenizer):
    # Like Qwen3, which drops the reasoning of every assistant turn but the last.
    tok = chat_tokenizer(tiny_tokenizer)
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>"
        "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="not a prefix of the whole conversation"):
        tokenize_chat(tok, CONVERSATION)
    assert tokenize_chat(tok, CONVERSATION[:3]).assistant_mask == [0] * 7 + [1, 1]


def test_no_chat_template_is_one_line_with_the_fix(tiny_tokenizer):
    with pytest.raises(ChatTemplateError, match="has no chat template; use a model whose tokenizer has one") as e:
        tokenize_chat(tiny_tokenizer, CONVERSATION)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "messages, message",
    [
        ("hello", "expected a non-empty list of {role, content} messages, got str"),
        ([], "expected a non-empty list"),
        ([{"content": "hi"}], "message 0 has no string 'role'"),
        ([{"role": "user", "content": None}], r"message 0 \(user\) has no string 'content'"),
    ],
)
def test_malformed_conversations_are_named(messages, message):
    with pytest.raises(ChatFormatError, match=message):
        check_messages(messages, "rows.jsonl:3")
