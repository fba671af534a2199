"""Local tokenizers and models: round-trips, named sizes, save/load."""

from __future__ import annotations

import pytest
import torch

from rlvr.modeling import (
    MODEL_SIZES,
    count_parameters,
    fresh_model,
    load_model_and_tokenizer,
    save_model_and_tokenizer,
    tokenizer_corpus,
    train_tokenizer,
)
from rlvr.task.data import load_examples


@pytest.fixture(scope="module")
def arith_tokenizer():
    return train_tokenizer(tokenizer_corpus(load_examples("arith:steps=2,max_value=20", limit=300)), vocab_size=640)


@pytest.mark.parametrize(
    "text",
    [
        "Mia has 7 apples. 7 + 5 = 12. </think> <answer> 12 </answer>",
        "  leading and trailing spaces  ",
        "tabs\tand\nnew lines\n\n",
        "ünïcödé — ✓ 数学 🙂",
        "a . b , c",
        "2,125 $18.00 \\boxed{3}",
        "",
    ],
)
def test_tokenizer_round_trips_any_text(arith_tokenizer, text):
    ids = arith_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert arith_tokenizer.decode(ids) == text


def test_tokenizer_learns_task_words_and_has_special_tokens(arith_tokenizer):
    assert len(arith_tokenizer) <= 640
    assert arith_tokenizer.pad_token == "<|pad|>" and arith_tokenizer.eos_token == "<|endoftext|>"
    assert arith_tokenizer.pad_token_id != arith_tokenizer.eos_token_id
    # Frequent task words and small numbers are single tokens, so responses stay short.
    for word in (" Mia", " apples", " starts", " 12", " </"):
        assert len(arith_tokenizer(word, add_special_tokens=False)["input_ids"]) == 1, word


def test_named_sizes(arith_tokenizer):
    with pytest.raises(ValueError, match="unknown model size"):
        fresh_model("huge", arith_tokenizer)
    tiny = fresh_model("tiny", arith_tokenizer, seed=0)
    assert tiny.config.hidden_size == MODEL_SIZES["tiny"]["hidden_size"]
    assert tiny.config.vocab_size == len(arith_tokenizer)
    assert count_parameters(tiny) < count_parameters(fresh_model("small", arith_tokenizer))
    again = fresh_model("tiny", arith_tokenizer, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(tiny.parameters(), again.parameters()))


def test_save_and_load_round_trip(arith_tokenizer, tmp_path):
    model = fresh_model("tiny", arith_tokenizer, seed=1).eval()
    out = save_model_and_tokenizer(model, arith_tokenizer, tmp_path / "ckpt")
    loaded, tok = load_model_and_tokenizer(out)
    text = "Mia has 7 apples. How many? 7 + 5 = 12."
    assert tok(text)["input_ids"] == arith_tokenizer(text)["input_ids"]
    assert tok.pad_token_id == arith_tokenizer.pad_token_id and tok.eos_token_id == arith_tokenizer.eos_token_id
    ids = torch.tensor([arith_tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded.eval()(ids).logits)


def test_attention_leaves_out_cudnn_on_a_gpu_and_restores_it(monkeypatch):
    """On a GPU, SDPA runs without the cuDNN backend (a host-side plan per new shape) and the backends
    come back afterwards; without a GPU nothing changes."""
    from rlvr.modeling import attention_without_cudnn

    before = torch.backends.cuda.cudnn_sdp_enabled()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with attention_without_cudnn():
        assert torch.backends.cuda.cudnn_sdp_enabled() == before
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with attention_without_cudnn():
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


def test_every_rlvr_command_runs_sdpa_without_cudnn_on_a_gpu(tmp_path, monkeypatch):
    """``rlvr eval``, ``sft``, ``dpo`` and the rest run inside ``attention_without_cudnn`` (the trainer also
    enters it itself, for ``train()`` called from Python)."""
    import importlib

    from rlvr import cli

    (tmp_path / "rlvr_sdpa_probe.py").write_text(
        "import torch\n"
        "SEEN = []\n"
        "def main(argv):\n"
        "    SEEN.append(torch.backends.cuda.cudnn_sdp_enabled())\n"
        "    return 0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.COMMANDS, "probe", ("rlvr_sdpa_probe", "a command that records the SDPA backends"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    assert cli.main(["probe"]) == 0
    assert importlib.import_module("rlvr_sdpa_probe").SEEN == [False]
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
