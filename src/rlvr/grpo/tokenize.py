"""Tokenising prompt/response pairs for policy-gradient and SFT losses."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The tokenizer's pad id, or its EOS id when it has no pad token."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad nor an EOS token; set tokenizer.pad_token first")
    return pad


def tokenize_prompt_and_output(
    prompt_strs: list[str], output_strs: list[str], tokenizer: PreTrainedTokenizerBase
) -> dict[str, torch.Tensor]:
    """Tokenise prompts and outputs separately, concatenate, right-pad, and shift by one.

    Returns ``input_ids`` (B, L-1) = padded[:, :-1], ``labels`` (B, L-1) = padded[:, 1:] and a
    boolean ``response_mask`` (B, L-1), True exactly where the label is a response token. L is the
    longest ``len(prompt_ids) + len(output_ids)`` in the batch. No special tokens are added.
    """
    if len(prompt_strs) != len(output_strs):
        raise ValueError(
            f"prompt_strs has {len(prompt_strs)} entries but output_strs has {len(output_strs)}; pass one output per prompt"
        )
    if not prompt_strs:
        raise ValueError("prompt_strs is empty: nothing to tokenise")
    prompt_ids = tokenizer(list(prompt_strs), add_special_tokens=False)["input_ids"]
    output_ids = tokenizer(list(output_strs), add_special_tokens=False)["input_ids"]
    return tokenize_from_ids(prompt_ids, output_ids, pad_token_id(tokenizer))


def tokenize_from_ids(prompt_ids: list[list[int]], output_ids: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """``tokenize_prompt_and_output`` for sequences that are already token ids."""
    lengths = [len(p) + len(o) for p, o in zip(prompt_ids, output_ids)]
    width = max(lengths)
    if width < 2:
        raise ValueError("every prompt+output is shorter than 2 tokens; there is nothing to predict")
    batch = len(prompt_ids)
    padded = torch.full((batch, width), pad_id, dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.bool)
    for i, (p, o) in enumerate(zip(prompt_ids, output_ids)):
        padded[i, : len(p) + len(o)] = torch.tensor(list(p) + list(o), dtype=torch.long)
        mask[i, len(p) : len(p) + len(o)] = True
    return {"input_ids": padded[:, :-1], "labels": padded[:, 1:], "response_mask": mask[:, 1:]}
