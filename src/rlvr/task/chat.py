"""Conversations as token ids: a list of ``{role, content}`` messages rendered with the tokenizer's chat
template, with a mask of the tokens that belong to the assistant's turns.

The mask is found the way TRL and open-instruct find it, by rendering prefixes of the conversation.
For the assistant message at index ``i``:

- ``before`` = the messages ``[:i]`` rendered with the generation prompt (``<|assistant|>\\n`` in most
  templates): where the model starts writing at inference;
- ``through`` = the messages ``[:i+1]`` rendered without it: where the turn ends, its end-of-turn
  token included (so the model learns to stop).

The characters ``[len(before), len(through))`` of the whole conversation's text are the turn. This
holds only if every such prefix is a prefix of the whole text (the *prefix property*); a template
that rewrites earlier turns when a later one is added (Qwen3 drops the reasoning of earlier assistant
turns) breaks it, and ``ChatTemplateError`` says so.

The text is then tokenized piece by piece, cut at those boundaries, without the tokenizer's own
special tokens (the template writes them). A token therefore never straddles a boundary, and the
tokens before each assistant turn are exactly the tokens of the prompt that an engine generates
from (the rendered ``before``, encoded alone): training and sampling see the same ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from rlvr.errors import UserError
from rlvr.task.example import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ASSISTANT = "assistant"


class ChatTemplateError(UserError, ValueError):
    """The tokenizer has no chat template, or its template cannot give an assistant-token mask."""


class ChatFormatError(DataError):
    """A conversation that is not a list of ``{role, content}`` messages."""


@dataclass(frozen=True)
class ChatTokens:
    """A rendered conversation: its text, its token ids, and which ids are the assistant's."""

    text: str
    input_ids: list[int]
    assistant_mask: list[int]
    """1 where the token belongs to an assistant turn (its end-of-turn text included), else 0."""


def check_chat_template(tokenizer: PreTrainedTokenizerBase, what: str = "chat rows", fix: str = "") -> None:
    """``ChatTemplateError`` (one line, with the fix) unless ``tokenizer`` has a chat template.

    ``what`` names what needed it; ``fix`` is the caller's own way out (an option to set), said first.
    """
    if getattr(tokenizer, "chat_template", None):
        return
    name = getattr(tokenizer, "name_or_path", "") or "the model"
    ways = [fix] if fix else []
    ways.append("use a model whose tokenizer has one (an instruct or chat model)")
    raise ChatTemplateError(f"{what}: the tokenizer of {name} has no chat template; {', or '.join(ways)}")


def check_messages(messages: Any, where: str = "messages") -> list[dict[str, str]]:
    """``messages`` when it is a non-empty list of ``{"role": str, "content": str}`` dicts; else
    ``ChatFormatError`` naming ``where`` (a file and line, a column) and the first bad message."""
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError(
            f"{where}: expected a non-empty list of {{role, content}} messages, got {type(messages).__name__}"
        )
    for k, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ChatFormatError(f'{where}: message {k} has no string \'role\'; write {{"role": ..., "content": ...}}')
        if not isinstance(message.get("content"), str):
            raise ChatFormatError(
                f"{where}: message {k} ({message['role']}) has no string 'content'; each message needs its text"
            )
    return cast(list[dict[str, str]], messages)


def is_messages(value: Any) -> bool:
    """Whether ``value`` looks like a conversation (a list whose items are dicts with a role)."""
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def render(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]], add_generation_prompt: bool = False
) -> str:
    """The text of ``messages`` in the tokenizer's chat template (the generation prompt appended when
    asked). An empty conversation renders as the generation prompt alone, or as nothing."""
    check_chat_template(tokenizer)
    if not messages:
        return _empty_prefix(tokenizer, add_generation_prompt)
    try:
        return cast(
            str,
            tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt),
        )
    except Exception as e:  # noqa: BLE001 (templates raise their own errors: raise_exception, TemplateError)
        roles = ", ".join(m["role"] for m in messages)
        raise ChatTemplateError(
            f"the chat template refused the conversation ({roles}): {str(e).splitlines()[0] if str(e) else e!r}; "
            "give messages in the roles and order the template accepts"
        ) from None


def _empty_prefix(tokenizer: PreTrainedTokenizerBase, add_generation_prompt: bool) -> str:
    """What a template writes before a conversation's first message when that message is the
    assistant's: the text shared by two one-message assistant conversations, up to the message."""
    if not add_generation_prompt:
        return ""
    marker = "\u2063rlvr-first-turn\u2063"
    try:
        text = cast(str, tokenizer.apply_chat_template([{"role": ASSISTANT, "content": marker}], tokenize=False))
    except Exception:  # noqa: BLE001 (a template that refuses to start with the assistant has no such prefix)
        return ""
    return text.split(marker, 1)[0] if marker in text else ""


def assistant_spans(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]], text: str | None = None
) -> list[tuple[int, int]]:
    """The character spans ``[start, end)`` of ``text`` (the rendered conversation) that are the
    assistant's turns; ``ChatTemplateError`` when the template breaks the prefix property."""
    if text is None:
        text = render(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != ASSISTANT:
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True)
        through = render(tokenizer, messages[: i + 1])
        for prefix, name in ((before, "with the generation prompt"), (through, "")):
            if not text.startswith(prefix):
                raise ChatTemplateError(
                    f"the chat template renders the conversation up to message {i} ({name or 'its turn'}) as text "
                    "that is not a prefix of the whole conversation, so the assistant's tokens cannot be "
                    "found by prefixes; use a template that leaves earlier turns unchanged "
                    "(or train on every token)"
                )
        if len(through) < len(before):
            raise ChatTemplateError(
                f"the chat template's generation prompt is longer than assistant message {i}'s whole turn; "
                "use a template whose generation prompt is the start of the assistant's turn"
            )
        spans.append((len(before), len(through)))
    return spans


def tokenize_pieces(tokenizer: PreTrainedTokenizerBase, text: str, cuts: Sequence[int]) -> list[list[int]]:
    """The token ids of ``text`` cut at the character offsets ``cuts`` (sorted, inside the text),
    each piece encoded alone, without the tokenizer's special tokens (a chat template writes them)."""
    bounds = [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    encoded = tokenizer([p for p in pieces if p], add_special_tokens=False)["input_ids"]
    out: list[list[int]] = []
    it = iter(encoded)
    for p in pieces:
        out.append(list(next(it)) if p else [])
    return out


def tokenize_chat(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]], assistant_only: bool = True
) -> ChatTokens:
    """``messages`` rendered with the chat template and tokenized, with the assistant-token mask.

    ``assistant_only=False`` marks every token (training on the whole conversation); the ids are the
    same either way.
    """
    text = render(tokenizer, messages)
    spans = assistant_spans(tokenizer, messages, text)
    cuts = sorted({c for span in spans for c in span if 0 < c < len(text)})
    pieces = tokenize_pieces(tokenizer, text, cuts)
    bounds = [0, *cuts]
    ids: list[int] = []
    mask: list[int] = []
    for start, piece in zip(bounds, pieces, strict=True):
        inside = not assistant_only or any(a <= start < b for a, b in spans)
        ids += piece
        mask += [int(inside)] * len(piece)
    return ChatTokens(text, ids, mask)


def tokenize_prompt_completion(
    tokenizer: PreTrainedTokenizerBase,
    prompt: Sequence[dict[str, str]],
    completion: Sequence[dict[str, str]],
) -> tuple[list[int], list[int]]:
    """The token ids of a prompt conversation (rendered with the generation prompt) and of the
    completion that follows it (the rest of ``prompt + completion``): how TRL splits a conversational
    preference pair. ``ChatTemplateError`` when the prompt is not a prefix of the whole."""
    head = render(tokenizer, prompt, add_generation_prompt=True)
    text = render(tokenizer, [*prompt, *completion])
    if not text.startswith(head):
        raise ChatTemplateError(
            "the chat template renders the prompt (with the generation prompt) as text that is not a prefix of "
            "the prompt and completion together; use a template that leaves earlier turns unchanged"
        )
    if len(text) == len(head):
        raise ChatFormatError("the completion renders as no text; give the assistant's reply")
    if not head:
        return [], tokenize_pieces(tokenizer, text, [])[0]
    prompt_ids, completion_ids = tokenize_pieces(tokenizer, text, [len(head)])
    return prompt_ids, completion_ids
