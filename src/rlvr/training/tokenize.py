"""Tokenising prompt/response pairs for policy-gradient and SFT losses."""

from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING

import numpy as np
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
    prompt_len = torch.tensor([len(p) for p in prompt_ids], dtype=torch.long)
    output_len = torch.tensor([len(o) for o in output_ids], dtype=torch.long)
    lengths = prompt_len + output_len
    width = int(lengths.max()) if len(lengths) else 0
    if width < 2:
        raise ValueError("every prompt+output is shorter than 2 tokens; there is nothing to predict")
    # One host tensor of every row's ids end to end, scattered into the padded batch at once (a row at a
    # time costs a tensor per row, which a rollout batch of hundreds of rows feels).
    pieces = chain.from_iterable(chain.from_iterable(zip(prompt_ids, output_ids)))
    flat = torch.from_numpy(np.fromiter(pieces, dtype=np.int64, count=int(lengths.sum())))
    rows = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    row_start = torch.cumsum(lengths, 0) - lengths
    cols = torch.arange(len(flat)) - torch.repeat_interleave(row_start, lengths)
    padded = torch.full((len(lengths), width), pad_id, dtype=torch.long)
    padded[rows, cols] = flat
    position = torch.arange(width)
    mask = (position >= prompt_len[:, None]) & (position < lengths[:, None])
    return {"input_ids": padded[:, :-1], "labels": padded[:, 1:], "response_mask": mask[:, 1:]}


def tokenize_from_pieces(
    prompt_ids: list[list[int]], pieces: list[list[tuple[list[int], bool]]], pad_id: int
) -> dict[str, torch.Tensor]:
    """``tokenize_from_ids`` for outputs made of pieces ``(ids, trained)``: a multi-turn conversation's
    model turns (trained) and the environment's messages between them (not). ``response_mask`` is
    True only where the label is a token of a trained piece; with one trained piece per output it is
    ``tokenize_from_ids``'s."""
    output_ids = [[t for ids, _ in row for t in ids] for row in pieces]
    out = tokenize_from_ids(prompt_ids, output_ids, pad_id)
    trained = torch.zeros(len(pieces), out["labels"].shape[1] + 1, dtype=torch.bool)
    for r, (prompt, row) in enumerate(zip(prompt_ids, pieces, strict=True)):
        at = len(prompt)
        for ids, is_trained in row:
            if is_trained:
                trained[r, at : at + len(ids)] = True
            at += len(ids)
    out["response_mask"] = trained[:, 1:]
    return out
