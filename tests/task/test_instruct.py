"""Instruction-tuning data: the Alpaca template, packing boundaries, BOS/EOS placement, the last partial
window, and the batches (hand-worked values)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from rlvr import get_packed_sft_dataset, iterate_batches
from rlvr.task.instruction_data import (
    alpaca_format,
    encode_document,
    pack_documents,
    protocol_file,
    protocol_template,
    special_prefix,
)

SHARED_SAFETY = Path(__file__).resolve().parents[2].parent / "shared" / "prompts" / "safety"
PROTOCOL_FILES = (
    "alpaca_sft.prompt",
    "zero_shot_system_prompt.prompt",
    "mmlu_zero_shot.prompt",
    "gsm8k_zero_shot.prompt",
    "alpaca_eval_zero_shot.prompt",
    "simple_safety_tests_zero_shot.prompt",
)
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def llama_like_tokenizer(texts, vocab_size: int = 400):
    """A byte-level BPE tokenizer that, like Llama-3's, prepends BOS to every encoding (add_special_tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=EOS)


@pytest.fixture(scope="module")
def llama_tok():
    return llama_like_tokenizer([protocol_file("alpaca_sft.prompt")] * 3 + ["What is 2 + 3? It is 5. Say hi. Hi!"] * 3)


PAIRS = [{"prompt": "What is 2 + 3?", "response": "It is 5."}, {"prompt": "Say hi.", "response": "Hi!"}]


def write_jsonl(path: Path, rows) -> Path:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


@pytest.mark.parametrize("name", PROTOCOL_FILES)
def test_protocol_prompts_ship_verbatim(name):
    shared = SHARED_SAFETY / name
    if not shared.is_file():
        pytest.skip("protocol prompts not found at ../shared/prompts/safety")
    assert protocol_file(name) == shared.read_text(encoding="utf-8")
    assert protocol_file(name).endswith("\n") and not protocol_template(name).endswith("\n")


def test_alpaca_template_written_out():
    assert alpaca_format("Say hi.", "Hi!") == (
        "Below is an instruction that describes a task. Write a response that appropriately completes the request."
        "\n\n### Instruction:\nSay hi.\n\n### Response:\nHi!"
    )
    assert alpaca_format("Say hi.").endswith("### Response:\n")


def test_packing_boundaries_and_last_partial_window():
    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]  # stream 1..9, N = 9
    ds = pack_documents(docs, 4)
    assert len(ds) == 2  # (9 - 1) // 4
    assert ds[0]["input_ids"].tolist() == [1, 2, 3, 4] and ds[0]["labels"].tolist() == [2, 3, 4, 5]
    # the label of a window's last token is the first token of the next window
    assert ds[1]["input_ids"].tolist() == [5, 6, 7, 8] and ds[1]["labels"].tolist() == [6, 7, 8, 9]
    assert ds[-1]["input_ids"].tolist() == [5, 6, 7, 8]
    with pytest.raises(IndexError):
        ds[2]
    with pytest.raises(IndexError):
        ds[-3]
    three = pack_documents(docs, 3)
    assert len(three) == 2  # [1,2,3] [4,5,6]; [7,8] is a partial window and is dropped
    assert three[1]["input_ids"].tolist() == [4, 5, 6] and three[1]["labels"].tolist() == [5, 6, 7]
    assert len(pack_documents(docs, 8)) == 1 and pack_documents(docs, 8)[0]["labels"].tolist() == list(range(2, 10))
    assert len(pack_documents(docs, 9)) == 0  # 9 tokens cannot fill 9 inputs plus one label
    assert ds[0]["input_ids"].dtype == torch.int64 and ds[0]["labels"].dtype == torch.int64


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_documents_start_with_bos_and_end_with_eos(llama_tok, tmp_path, suffix):
    path = write_jsonl(tmp_path / f"sft{suffix}", PAIRS)
    ds = get_packed_sft_dataset(tokenizer=llama_tok, dataset_path=path, seq_length=8, shuffle=False)
    bos, eos = llama_tok.bos_token_id, llama_tok.eos_token_id
    plain = [llama_tok(alpaca_format(p["prompt"], p["response"]), add_special_tokens=False)["input_ids"] for p in PAIRS]
    stream = [bos] + plain[0] + [eos] + [bos] + plain[1] + [eos]
    assert ds.stream.tolist() == stream
    assert len(ds) == (len(stream) - 1) // 8
    for i in range(len(ds)):
        assert ds[i]["input_ids"].tolist() == stream[8 * i : 8 * i + 8]
        assert ds[i]["labels"].tolist() == stream[8 * i + 1 : 8 * i + 9]
    # no newline before EOS: the text right before each EOS ends with the response itself
    first_eos = stream.index(eos)
    assert llama_tok.decode(stream[1:first_eos]).endswith("### Response:\nIt is 5.")
    assert (
        encode_document(llama_tok, alpaca_format(PAIRS[0]["prompt"], PAIRS[0]["response"])) == stream[: first_eos + 1]
    )


def test_tokenizer_without_bos_gets_eos_only(tiny_tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "sft.jsonl", PAIRS)
    ds = get_packed_sft_dataset(tiny_tokenizer, path, seq_length=4, shuffle=False)
    plain = [
        tiny_tokenizer(alpaca_format(p["prompt"], p["response"]), add_special_tokens=False)["input_ids"] for p in PAIRS
    ]
    assert ds.stream.tolist() == plain[0] + [tiny_tokenizer.eos_token_id] + plain[1] + [tiny_tokenizer.eos_token_id]


def test_shuffle_permutes_whole_documents(llama_tok, tmp_path):
    rows = [{"prompt": f"Say {w}.", "response": w} for w in ("one", "two", "three", "four", "five", "six")]
    path = write_jsonl(tmp_path / "sft.jsonl", rows)
    ordered = get_packed_sft_dataset(llama_tok, path, 4, shuffle=False).stream.tolist()
    a = get_packed_sft_dataset(llama_tok, path, 4, shuffle=True).stream.tolist()
    b = get_packed_sft_dataset(llama_tok, path, 4, shuffle=True).stream.tolist()
    assert a == b and a != ordered  # seeded: reproducible, and a real permutation

    def documents(stream):
        docs, cur = [], []
        for t in stream:
            cur.append(t)
            if t == llama_tok.eos_token_id:
                docs.append(tuple(cur))
                cur = []
        return docs

    assert sorted(documents(a)) == sorted(documents(ordered)) and len(documents(a)) == 6


def test_iterate_batches_one_epoch_with_a_short_last_batch():
    ds = pack_documents([list(range(1, 24))], 2)  # 23 tokens: (23 - 1) // 2 = 11 windows
    assert len(ds) == 11
    batches = iterate_batches(ds, batch_size=4, shuffle=False)
    assert len(batches) == 3  # ceil(11 / 4)
    got = list(batches)
    assert [b["input_ids"].shape for b in got] == [(4, 2), (4, 2), (3, 2)]
    assert got[2]["input_ids"].tolist() == [[17, 18], [19, 20], [21, 22]]
    assert got[2]["labels"].tolist() == [[18, 19], [20, 21], [22, 23]]
    shuffled = list(iterate_batches(ds, batch_size=4, shuffle=True, seed=0))
    firsts = sorted(int(row[0]) for b in shuffled for row in b["input_ids"])
    assert firsts == list(range(1, 23, 2))  # every window exactly once
    assert [b["input_ids"].tolist() for b in shuffled] == [
        b["input_ids"].tolist() for b in iterate_batches(ds, batch_size=4, shuffle=True, seed=0)
    ]


def test_special_prefix(llama_tok, tiny_tokenizer):
    assert special_prefix(llama_tok) == BOS
    assert (
        llama_tok(special_prefix(llama_tok) + "Hi", add_special_tokens=False)["input_ids"]
        == llama_tok("Hi")["input_ids"]
    )
    assert special_prefix(tiny_tokenizer) == ""


def test_bad_rows_name_the_line(tmp_path, llama_tok):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(PAIRS[0]) + "\n" + json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .*response"):
        get_packed_sft_dataset(llama_tok, path, 8, shuffle=False)


# --- conversational rows (TRL's messages and prompt/completion formats) --------------------------


def test_packed_windows_keep_the_loss_mask():
    # stream 1..7 with mask [0 1 1 | 0 0 1 1]: a label carries loss where the mask of its token is 1
    ds = pack_documents([[1, 2, 3], [4, 5, 6, 7]], 3, masks=[[0, 1, 1], [0, 0, 1, 1]])
    assert ds.masked and len(ds) == 2
    assert ds[0]["input_ids"].tolist() == [1, 2, 3] and ds[0]["labels"].tolist() == [2, 3, -100]
    assert ds[1]["input_ids"].tolist() == [4, 5, 6] and ds[1]["labels"].tolist() == [-100, 6, 7]
    assert not pack_documents([[1, 2, 3]], 2).masked


def test_the_three_row_shapes_are_read_and_a_fourth_is_named(tmp_path):
    from rlvr.task.data import DataError
    from rlvr.task.instruction_data import load_sft_rows

    chat = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    rows = [
        {"instruction": "Say hi.", "output": "hi"},
        {"messages": chat},
        {"instruction": chat[:1], "completion": chat[1:]},
    ]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    assert load_sft_rows(path, prompt_field="instruction", response_field="output") == [
        {"prompt": "Say hi.", "response": "hi"},
        {"messages": chat},
        {"prompt": chat[:1], "completion": chat[1:]},
    ]
    write_jsonl(path, [{"text": "plain"}])
    with pytest.raises(DataError, match=r"row 1: expected prompt and response strings \(Alpaca\), a messages list"):
        load_sft_rows(path)
    write_jsonl(path, [{"messages": [{"role": "user"}]}])
    with pytest.raises(DataError, match=r"row 1, messages: message 0 \(user\) has no string 'content'"):
        load_sft_rows(path)
    write_jsonl(path, [{"messages": chat}, {"messages": chat[:1]}])
    with pytest.raises(
        DataError, match=r"row 2, messages: no message has role 'assistant', so the row carries no loss"
    ):
        load_sft_rows(path)


def test_conversations_carry_loss_on_the_assistant_and_alpaca_rows_on_every_token(tiny_tokenizer):
    from conftest import chat_tokenizer

    from rlvr.task.instruction_data import encode_pairs, encode_sft_rows

    tok = chat_tokenizer(tiny_tokenizer)
    alpaca = {"prompt": "Say hi.", "response": "hi"}
    chat = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    rows = [alpaca, {"messages": chat}, {"prompt": chat[:1], "completion": chat[1:]}]
    documents, masks = encode_sft_rows(tok, rows)
    ids = tok.convert_tokens_to_ids
    conversation = ids(["<|user|>", "Q", "<|end|>", "<|assistant|>", "A", "<|endoftext|>"])
    assert documents == [encode_pairs(tok, [alpaca])[0], conversation, conversation]
    assert masks == [[1] * len(documents[0]), [0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 1, 1]]
    _, every = encode_sft_rows(tok, rows, assistant_only=False)
    assert every == [[1] * len(d) for d in documents]
    assert encode_sft_rows(tok, [alpaca]) == (encode_pairs(tok, [alpaca]), None)  # no mask: today's windows


def test_conversations_need_a_chat_template(tiny_tokenizer):
    from rlvr.task.chat import ChatTemplateError
    from rlvr.task.instruction_data import encode_sft_rows

    rows = [{"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}]
    with pytest.raises(ChatTemplateError, match="no chat template; pass --chat-template FILE"):
        encode_sft_rows(tiny_tokenizer, rows)
