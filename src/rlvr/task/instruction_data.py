"""Instruction-tuning data: the Alpaca template, packed SFT sequences, and their batches.

An instruction-tuning example is a ``{prompt, response}`` pair. It is written in the Alpaca template
(``prompts/alpaca_sft.prompt``, the protocol file minus its trailing newline, so that no newline sits
before EOS), encoded with the tokenizer's own special tokens (Llama-3 prepends ``<|begin_of_text|>``),
and closed with EOS. Documents are concatenated into one token stream and cut into windows of
``seq_length`` tokens, each predicting the stream shifted by one::

    stream = [doc 1 ... EOS][doc 2 ... EOS][doc 3 ...
    item i = {"input_ids": stream[i*m : (i+1)*m], "labels": stream[i*m+1 : (i+1)*m+1]}

There are ``(N - 1) // m`` windows for a stream of N tokens: the last partial window is dropped, and
the label of a window's last token is the first token of the next one. A window may span two
documents and attends across the boundary (no block-diagonal mask), and every token carries loss:
this is the course's packing, cheap and padding-free.

Conversational rows (TRL's formats) are rendered with the tokenizer's chat template (``rlvr.task.chat``):
``{"messages": [...]}`` carries loss on its assistant turns, ``{"prompt": [...], "completion": [...]}``
on its completion; ``assistant_only=False`` puts loss on every token. The packed stream then keeps a
mask beside it, and a label whose token carries no loss is ``-100``. A file of Alpaca rows only has
no mask: its windows are exactly the course's.

The training loop that uses them is ``rlvr.commands.sft_instruct`` (``rlvr sft instruct``).
"""

from __future__ import annotations

import gzip
import json
import random
import zlib
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, cast

import torch

from rlvr.task.chat import (
    ASSISTANT,
    check_chat_template,
    check_messages,
    is_messages,
    tokenize_chat,
    tokenize_prompt_completion,
)
from rlvr.task.data import DataError, not_utf8

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ALPACA_TEMPLATE = "alpaca_sft.prompt"


@cache
def protocol_file(filename: str) -> str:
    """A protocol prompt file shipped in ``rlvr/prompts``, byte for byte."""
    return resources.files("rlvr.task.prompts").joinpath(filename).read_text(encoding="utf-8")


def protocol_template(filename: str) -> str:
    """A protocol prompt without its one trailing newline: the form that is embedded in another
    template or followed by EOS."""
    text = protocol_file(filename)
    return text[:-1] if text.endswith("\n") else text


def alpaca_format(instruction: str, response: str = "") -> str:
    """``instruction`` and ``response`` in the Alpaca template (no trailing newline).

    With an empty response this is the prompt of a fine-tuned model: it ends with ``### Response:\\n``.
    """
    return protocol_template(ALPACA_TEMPLATE).format(instruction=instruction, response=response)


def alpaca_fixed_parts() -> tuple[str, str]:
    """The Alpaca template's two fixed pieces of text: before the instruction, and between the
    instruction and the response."""
    template = protocol_template(ALPACA_TEMPLATE)
    head, rest = template.split("{instruction}")
    middle, _ = rest.split("{response}")
    return head, middle


def encode_documents(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    """Token ids of each text with the tokenizer's own special tokens (BOS for Llama-3), then EOS.

    A tokenizer that already closes its encodings with EOS does not get a second one.
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no EOS token; SFT documents must end with one (set tokenizer.eos_token)")
    if not texts:
        return []
    documents = []
    for start in range(0, len(texts), 4096):  # in slices: a corpus of 200k documents at once holds too much
        for ids in tokenizer(list(texts[start : start + 4096]))["input_ids"]:
            ids = list(ids)
            if not ids or ids[-1] != eos:
                ids.append(eos)
            documents.append(ids)
    return documents


def encode_document(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """``encode_documents`` for one text."""
    return encode_documents(tokenizer, [text])[0]


def special_prefix(tokenizer: PreTrainedTokenizerBase) -> str:
    """The text of the special tokens the tokenizer puts before every encoding (``<|begin_of_text|>``
    for Llama-3, ``""`` for tokenizers that add none).

    Rollout engines encode prompts without special tokens; prefixing this string gives a prompt the
    same first tokens as an SFT document.
    """
    with_special = tokenizer("a")["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    for start in range(len(with_special) - len(plain) + 1):
        if with_special[start : start + len(plain)] == plain:
            return cast(str, tokenizer.decode(with_special[:start])) if start else ""
    return ""


# ---------------------------------------------------------------------------------------------
# Reading {prompt, response} data
# ---------------------------------------------------------------------------------------------


def _open_text(path: Path) -> TextIO:
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8")


def read_jsonl(path: str | Path, required: tuple[str, ...] = (), limit: int | None = None) -> list[dict]:
    """Rows of a JSONL or JSONL.gz file; a malformed row is an error naming the file and the line."""

    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file; pass a JSONL or JSONL.gz file")
    rows: list[dict] = []
    try:
        with _open_text(path) as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(
                        f"{path}:{lineno}: not valid JSON ({e.msg}); each line must be one JSON object"
                    ) from None
                missing = [k for k in required if not isinstance(row, dict) or not isinstance(row.get(k), str)]
                if missing:
                    raise DataError(
                        f"{path}:{lineno}: expected string fields {', '.join(required)}; "
                        f"{', '.join(missing)} missing or not a string"
                    )
                rows.append(row)
                if limit is not None and len(rows) >= limit:
                    break
    except UnicodeDecodeError as e:
        raise DataError(not_utf8(path, e)) from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise DataError(
            f"{path}: not a whole gzip file ({e}); download it again, or give the uncompressed .jsonl"
        ) from None
    return rows


def _is_local(source: str) -> bool:
    return Path(source).exists() or source.endswith((".jsonl", ".jsonl.gz", ".json"))


def load_prompt_response(
    source: str | Path,
    split: str = "train",
    limit: int | None = None,
    prompt_field: str = "prompt",
    response_field: str = "response",
) -> list[dict]:
    """``[{"prompt", "response"}]`` from a JSONL(.gz) file or a hub dataset with those two columns."""
    source = str(source)
    if _is_local(source):
        rows = read_jsonl(source, required=(prompt_field, response_field), limit=limit)
    else:
        import datasets

        ds = datasets.load_dataset(source, split=split)
        missing = {prompt_field, response_field} - set(ds.column_names)
        if missing:
            raise DataError(
                f"the hub dataset {source!r} has no column(s) {sorted(missing)}; its columns are "
                f"{ds.column_names}: name the right ones with --prompt-field / --response-field"
            )
        rows = ds.select(range(min(limit, len(ds)))) if limit is not None else ds
    return [{"prompt": r[prompt_field], "response": r[response_field]} for r in rows]


def load_sft_rows(
    source: str | Path,
    split: str = "train",
    limit: int | None = None,
    prompt_field: str = "prompt",
    response_field: str = "response",
) -> list[dict]:
    """Instruction-tuning rows from a JSONL(.gz) file or a hub dataset, each in one of three shapes:

    - ``{"prompt": str, "response": str}``: an Alpaca pair (read from ``prompt_field`` / ``response_field``);
    - ``{"messages": [...]}``: a conversation (TRL's conversational language-modeling rows);
    - ``{"prompt": [...], "completion": [...]}``: message lists (TRL's conversational prompt-completion rows).

    A row of none of these shapes is a ``DataError`` naming it and the shapes."""

    source = str(source)
    if _is_local(source):
        raw: Any = read_jsonl(source, limit=limit)
    else:
        import datasets

        raw = datasets.load_dataset(source, split=split)
        if limit is not None:
            raw = raw.select(range(min(limit, len(raw))))
    rows = []
    for i, row in enumerate(raw):
        where = f"{source} row {i + 1}"
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
        if "messages" in row:
            messages = check_messages(row["messages"], f"{where}, messages")
            if not any(m["role"] == ASSISTANT for m in messages):
                # with the loss on the assistant's turns only, such a row would train on nothing
                raise DataError(
                    f"{where}, messages: no message has role 'assistant', so the row carries no loss; "
                    "add the assistant's reply or drop the row"
                )
            rows.append({"messages": messages})
        elif is_messages(row.get(prompt_field)) or is_messages(row.get("completion")):
            rows.append(
                {
                    "prompt": check_messages(row.get(prompt_field), f"{where}, {prompt_field}"),
                    "completion": check_messages(row.get("completion"), f"{where}, completion"),
                }
            )
        elif isinstance(row.get(prompt_field), str) and isinstance(row.get(response_field), str):
            rows.append({"prompt": row[prompt_field], "response": row[response_field]})
        else:
            raise DataError(
                f"{where}: expected {prompt_field} and {response_field} strings (Alpaca), a messages list, or "
                f"{prompt_field} and completion message lists; its fields are {sorted(row)} (name the Alpaca "
                "ones with --prompt-field / --response-field)"
            )
    return rows


def is_alpaca(row: dict) -> bool:
    """Whether an instruction-tuning row (``load_sft_rows``) is an Alpaca pair rather than a conversation."""
    return "response" in row


def row_text(row: dict) -> str:
    """Plain text of a row, for training a fresh tokenizer: the Alpaca document, or a conversation's messages."""
    if is_alpaca(row):
        return alpaca_format(row["prompt"], row["response"])
    messages = row.get("messages") or [*row["prompt"], *row["completion"]]
    return "\n".join(m["content"] for m in messages)


def encode_sft_rows(
    tokenizer: PreTrainedTokenizerBase, rows: list[dict], assistant_only: bool = True
) -> tuple[list[list[int]], list[list[int]] | None]:
    """``(documents, loss masks)`` of ``load_sft_rows`` rows: Alpaca pairs as ``encode_pairs`` makes them
    (every token carries loss), conversations rendered with the chat template with loss on the
    assistant's turns (``messages``) or on the completion (``prompt``/``completion``); every token with
    ``assistant_only=False``. The masks are None when every row is an Alpaca pair."""

    alpaca = [i for i, r in enumerate(rows) if is_alpaca(r)]
    alpaca_docs = encode_pairs(tokenizer, [rows[i] for i in alpaca])
    if len(alpaca) == len(rows):
        return alpaca_docs, None
    check_chat_template(
        tokenizer, "conversational rows (messages, prompt/completion lists)", "pass --chat-template FILE"
    )
    documents: list[list[int]] = [[] for _ in rows]
    masks: list[list[int]] = [[] for _ in rows]
    for i, doc in zip(alpaca, alpaca_docs, strict=True):
        documents[i], masks[i] = doc, [1] * len(doc)
    for i, row in enumerate(rows):
        if is_alpaca(row):
            continue
        if "messages" in row:
            chat = tokenize_chat(tokenizer, row["messages"], assistant_only)
            documents[i], masks[i] = chat.input_ids, chat.assistant_mask
        else:
            prompt_ids, completion_ids = tokenize_prompt_completion(tokenizer, row["prompt"], row["completion"])
            documents[i] = prompt_ids + completion_ids
            masks[i] = [int(not assistant_only)] * len(prompt_ids) + [1] * len(completion_ids)
    return documents, masks


# ---------------------------------------------------------------------------------------------
# Packing
# ---------------------------------------------------------------------------------------------


class PackedSFTDataset(torch.utils.data.Dataset):
    """Windows of ``seq_length`` tokens over one token stream (see the module docstring)."""

    def __init__(self, stream: torch.Tensor, seq_length: int, loss_mask: torch.Tensor | None = None):
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        if loss_mask is not None and loss_mask.shape != stream.shape:
            raise ValueError(f"the loss mask has shape {tuple(loss_mask.shape)}, the stream {tuple(stream.shape)}")
        # int32 storage halves the memory of a large corpus; items come out as int64
        self.stream = stream.to(torch.int32 if stream.numel() == 0 or int(stream.max()) < 2**31 else torch.long)
        self.seq_length = seq_length
        self.loss_mask = None if loss_mask is None else loss_mask.bool()
        """Which stream tokens carry loss as labels (None: every one)."""

    @property
    def masked(self) -> bool:
        """Whether some labels are ``-100`` (tokens without loss)."""
        return self.loss_mask is not None

    def __len__(self) -> int:
        return max(0, (self.stream.numel() - 1) // self.seq_length)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {i} is out of range for {n} packed sequences")
        m = self.seq_length
        labels = self.stream[i * m + 1 : (i + 1) * m + 1].long()
        if self.loss_mask is not None:
            labels = labels.masked_fill(~self.loss_mask[i * m + 1 : (i + 1) * m + 1], IGNORE_INDEX)
        return {"input_ids": self.stream[i * m : (i + 1) * m].long(), "labels": labels}


IGNORE_INDEX = -100
"""The label of a token that carries no loss (the value PyTorch and transformers use)."""


def pack_documents(
    documents: list[list[int]], seq_length: int, masks: list[list[int]] | None = None
) -> PackedSFTDataset:
    """Concatenate token-id documents (already ordered) into one stream and window it; ``masks``
    (one 0/1 list per document) says which tokens carry loss as labels."""
    import itertools

    import numpy as np

    def flat(lists: list[list[int]]) -> torch.Tensor:
        total = sum(len(x) for x in lists)
        return torch.from_numpy(np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=total))

    if masks is not None and [len(m) for m in masks] != [len(d) for d in documents]:
        raise ValueError("each document needs a loss mask of its own length")
    return PackedSFTDataset(flat(documents), seq_length, None if masks is None else flat(masks))


def encode_pairs(tokenizer: PreTrainedTokenizerBase, pairs: list[dict]) -> list[list[int]]:
    """Each ``{prompt, response}`` as an Alpaca-formatted, special-token-framed document."""
    return encode_documents(tokenizer, [alpaca_format(p["prompt"], p["response"]) for p in pairs])


def get_packed_sft_dataset(
    tokenizer: PreTrainedTokenizerBase, dataset_path: str | Path, seq_length: int, shuffle: bool, seed: int = 0
) -> PackedSFTDataset:
    """The packed instruction-tuning dataset of a ``{prompt, response}`` JSONL(.gz) file.

    Documents are shuffled first (with ``random.Random(seed)``) when ``shuffle`` is set. Item ``i`` is
    ``{"input_ids": stream[i*m:(i+1)*m], "labels": stream[i*m+1:(i+1)*m+1]}`` as int64 tensors, with
    ``len = (N - 1) // m``; an index past the end raises ``IndexError``.
    """
    documents = encode_pairs(tokenizer, load_prompt_response(dataset_path))
    if shuffle:
        random.Random(seed).shuffle(documents)
    return pack_documents(documents, seq_length)


def iterate_batches(
    dataset: torch.utils.data.Dataset, batch_size: int, shuffle: bool, seed: int | None = None
) -> torch.utils.data.DataLoader:
    """One epoch of dict batches of ``dataset`` (a ``torch.utils.data.DataLoader``): ``len`` is
    ``ceil(len(dataset) / batch_size)`` and the last batch may be short. ``seed`` fixes the order."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    generator = torch.Generator().manual_seed(seed) if (shuffle and seed is not None) else None
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=generator)
