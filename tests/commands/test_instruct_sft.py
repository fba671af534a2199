"""`rlvr sft instruct`: accumulated microbatches give the full batch's gradient, training lowers the
validation loss, the checkpoint loads back, and bad input is a one-line error."""

from __future__ import annotations

import json

import pytest
import torch

from rlvr.commands.sft_instruct import InstructSFTConfig, accumulate_step, masked_nll_sum, run_instruct_sft, token_nll
from rlvr.errors import UserError
from rlvr.task.instruction_data import pack_documents


def test_accumulated_microbatches_equal_the_full_batch(tiny_model):
    ds = pack_documents([list(range(3, 60)), list(range(5, 40))], 8)  # 92 tokens: 11 windows of 8
    indices = [0, 3, 4, 7, 9]
    grads = []
    for rows in (5, 2, 1):
        tiny_model.zero_grad()
        loss, tokens = accumulate_step(tiny_model, ds, indices, rows)
        grads.append((loss, [p.grad.clone() for p in tiny_model.parameters()]))
        assert tokens == 5 * 8
    tiny_model.zero_grad()
    full = token_nll(
        tiny_model, torch.stack([ds[i]["input_ids"] for i in indices]), torch.stack([ds[i]["labels"] for i in indices])
    )
    full.backward()
    for loss, g in grads:
        assert loss == pytest.approx(full.item(), rel=1e-5)
        assert all(torch.allclose(a, p.grad, atol=1e-6, rtol=1e-4) for a, p in zip(g, tiny_model.parameters()))


def test_masked_windows_average_over_the_labels_with_loss(tiny_model):
    # Two documents whose first halves carry no loss; microbatches of any size give the mean NLL over
    # the labels with loss of the whole batch, and that sum is the log-softmax read at those labels.
    docs = [list(range(3, 60)), list(range(5, 40))]
    masks = [[0] * 30 + [1] * 27, [0] * 15 + [1] * 20]
    ds = pack_documents(docs, 8, masks)
    indices = [0, 3, 4, 7, 9]
    input_ids = torch.stack([ds[i]["input_ids"] for i in indices])
    labels = torch.stack([ds[i]["labels"] for i in indices])
    keep = labels != -100
    # loss on stream positions 30..56 and 72..91; window i's labels are positions 8i+1..8i+8:
    # window 0 none, 3 three (30..32), 4 all eight, 7 none (57..64), 9 all eight
    assert keep.sum(1).tolist() == [0, 3, 8, 0, 8]
    with torch.no_grad():
        log_softmax = torch.log_softmax(tiny_model(input_ids).logits.float(), -1)
        by_hand = -log_softmax.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)[keep].sum()
        assert float(masked_nll_sum(tiny_model, input_ids, labels)) == pytest.approx(float(by_hand), rel=1e-5)
    grads = []
    for rows in (5, 2, 1):
        tiny_model.zero_grad()
        loss, _ = accumulate_step(tiny_model, ds, indices, rows)
        grads.append((loss, [p.grad.clone() for p in tiny_model.parameters()]))
    tiny_model.zero_grad()
    full = masked_nll_sum(tiny_model, input_ids, labels) / 19
    full.backward()
    for loss, g in grads:
        assert loss == pytest.approx(full.item(), rel=1e-5)
        assert all(torch.allclose(a, p.grad, atol=1e-6, rtol=1e-4) for a, p in zip(g, tiny_model.parameters()))


def _data(tmp_path, n=120):
    path = tmp_path / "sft.jsonl"
    with path.open("w") as f:
        for i in range(n):
            a, b = i % 7, (i * 3) % 5
            f.write(json.dumps({"prompt": f"What is {a} plus {b}?", "response": f"{a} + {b} = {a + b}."}) + "\n")
    return path


def test_instruct_sft_lowers_validation_loss_and_saves_a_loadable_model(tmp_path):
    from rlvr.modeling import load_model_and_tokenizer

    out = run_instruct_sft(
        InstructSFTConfig(
            data=str(_data(tmp_path)),
            model="tiny",
            out=tmp_path / "run",
            seq_length=32,
            batch_size=8,
            lr=1e-2,
            steps=12,
            val_size=16,
            eval_every=6,
            max_tokens_per_microbatch=64,
            vocab_size=300,
            progress=False,
            device="cpu",
        )
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = [r["val/loss"] for r in rows if "val/loss" in r]
    assert [r["step"] for r in rows if "val/loss" in r] == [0, 6, 12] and val[-1] < 0.7 * val[0]
    assert [r["step"] for r in rows if "train/loss" in r] == list(range(1, 13))
    lrs = [r["lr"] for r in rows if "lr" in r]
    assert lrs[0] == pytest.approx(1e-2 / 1) and lrs[-1] < lrs[1]  # ceil(3 % of 12) = 1 warm-up step, then cosine
    config = json.loads((out / "sft_config.json").read_text())
    assert config["val_documents"] == 16 and config["train_documents"] == 104 and config["lr"] == 1e-2
    model, tokenizer = load_model_and_tokenizer(out)
    assert model.config.vocab_size == len(tokenizer)
    with pytest.raises(UserError, match="--overwrite"):
        run_instruct_sft(
            InstructSFTConfig(data=str(_data(tmp_path)), model="tiny", out=out, steps=1, val_size=16, progress=False)
        )


def test_course_defaults():
    cfg = InstructSFTConfig(data="d.jsonl", model="m", out="o")
    assert (
        cfg.seq_length,
        cfg.batch_size,
        cfg.lr,
        cfg.warmup_ratio,
        cfg.weight_decay,
        cfg.max_grad_norm,
        cfg.epochs,
    ) == (512, 32, 2e-5, 0.03, 0.1, 1.0, 1.0)


def test_cli_dispatch_and_errors(tmp_path, capsys):
    from rlvr.cli import main

    assert (
        main(
            [
                "sft",
                "instruct",
                "--data",
                str(tmp_path / "missing.jsonl"),
                "--model",
                "tiny",
                "--out",
                str(tmp_path / "o"),
            ]
        )
        == 2
    )
    assert "missing.jsonl: no such file" in capsys.readouterr().err
    assert (
        main(
            [
                "sft",
                "instruct",
                "--data",
                str(_data(tmp_path)),
                "--model",
                "not-a-size",
                "--out",
                str(tmp_path / "o"),
                "--no-progress",
            ]
        )
        == 2
    )
    assert "named size" in capsys.readouterr().err


def _chat_data(tmp_path, n=120):
    path = tmp_path / "chat.jsonl"
    with path.open("w") as f:
        for i in range(n):
            a, b = i % 7, (i * 3) % 5
            messages = [
                {"role": "system", "content": "Add."},
                {"role": "user", "content": f"{a} plus {b}?"},
                {"role": "assistant", "content": f"{a + b}."},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def test_chat_rows_train_on_the_assistant_with_a_given_template(tmp_path):
    from conftest import TOKEN_CHAT_TEMPLATE

    from rlvr.modeling import load_model_and_tokenizer

    template = tmp_path / "chat.jinja"
    template.write_text(TOKEN_CHAT_TEMPLATE)
    settings = dict(
        data=str(_chat_data(tmp_path)),
        model="tiny",
        seq_length=32,
        batch_size=8,
        lr=1e-2,
        steps=12,
        val_size=16,
        eval_every=6,
        max_tokens_per_microbatch=64,
        vocab_size=300,
        progress=False,
        device="cpu",
    )
    with pytest.raises(
        UserError,
        match="a fresh model of size tiny has a new tokenizer without a chat template; pass --chat-template FILE",
    ):
        run_instruct_sft(InstructSFTConfig(**settings, out=tmp_path / "no-template"))
    out = run_instruct_sft(InstructSFTConfig(**settings, out=tmp_path / "run", chat_template=template))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = [r["val/loss"] for r in rows if "val/loss" in r]
    assert val[-1] < 0.7 * val[0]
    _, tokenizer = load_model_and_tokenizer(out)
    assert tokenizer.chat_template == TOKEN_CHAT_TEMPLATE  # saved with the model, for GRPO and eval
