"""Batched text <-> token ids through a fast tokenizer's Rust backend, equal to the tokenizer's own calls.

transformers' ``batch_decode`` decodes a batch one sequence at a time from Python, and its ``__call__``
wraps every row's encoding in Python objects; the backend (``tokenizers``) encodes and decodes a whole
batch in parallel threads. A rollout batch (256 responses of 512 tokens) is decoded once by the engine
and encoded once by the trainer, with the GPU idle meanwhile, so these two calls go to the backend
directly when doing so gives the same ids and text: no truncation, padding or clean-up of
tokenization spaces configured, special tokens encoded as the tokenizer would. Anything else (a slow
tokenizer, those settings) takes the tokenizer's own path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def _backend(tokenizer: PreTrainedTokenizerBase) -> Any | None:
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch") or not hasattr(backend, "decode_batch"):
        return None
    return backend


def encode_texts(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> list[list[int]]:
    """``tokenizer(list(texts), add_special_tokens=False)["input_ids"]``."""
    backend = _backend(tokenizer)
    plain = (
        backend is not None
        and backend.truncation is None
        and backend.padding is None
        and getattr(backend, "encode_special_tokens", None) == bool(getattr(tokenizer, "split_special_tokens", False))
    )
    if not plain:
        return tokenizer(list(texts), add_special_tokens=False)["input_ids"]  # type: ignore[no-any-return]
    # encode_batch_fast skips the character offsets, which nothing here reads (same ids).
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # type: ignore[union-attr]
    return [e.ids for e in encode(list(texts), add_special_tokens=False)]


def decode_texts(
    tokenizer: PreTrainedTokenizerBase, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = True
) -> list[str]:
    """``tokenizer.batch_decode(sequences, skip_special_tokens=...)``."""
    backend = _backend(tokenizer)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer.batch_decode([list(s) for s in sequences], skip_special_tokens=skip_special_tokens)
    return backend.decode_batch([list(s) for s in sequences], skip_special_tokens=skip_special_tokens)  # type: ignore[no-any-return]


def longest_prompt(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str]) -> tuple[int, int]:
    """``(index, tokens)`` of the longest of ``prompts`` in tokens (``(-1, 0)`` for none)."""
    lengths = [len(ids) for ids in encode_texts(tokenizer, prompts)] if prompts else []
    if not lengths:
        return -1, 0
    index = max(range(len(lengths)), key=lengths.__getitem__)
    return index, lengths[index]


def context_length(model: Any) -> int | None:
    """The positions a model can attend over (``max_position_embeddings``), when its config says."""
    value = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None
