"""SFT: the loss sees response tokens only, training lowers it, the checkpoint reloads exactly."""

from __future__ import annotations

import json

import pytest
import torch

from rlvr.commands.sft import SFTConfig, run_sft, sft_loss, sft_pairs, sft_response
from rlvr.errors import UserError
from rlvr.task.data import Example, load_examples
from rlvr.training.metrics_log import read_metrics
from rlvr.training.optim import lr_factor

TASK = "arith:steps=1,max_value=10"


def test_responses_in_r1_zero_format():
    ex = Example("q?", "18", "Half of 36 is 36/2 = 18.")
    assert sft_response(ex) == "Half of 36 is 36/2 = 18. </think> <answer> 18 </answer>"
    full = Example("q?", "3", " 1 + 2 = 3. </think> <answer> 3 </answer>")
    assert sft_response(full) == full.solution
    with pytest.raises(ValueError, match="no solution"):
        sft_response(Example("q?", "3"))


def test_gsm8k_rationales_become_r1_zero(gsm8k_path):
    from rlvr.task.grading import r1_zero_reward_fn

    examples = load_examples(str(gsm8k_path), "train", limit=20)
    _, responses = sft_pairs(examples)
    for ex, response in zip(examples, responses):
        assert "<<" not in response and response.endswith(f" </think> <answer> {ex.ground_truth} </answer>")
        assert r1_zero_reward_fn(response, ex.ground_truth)["reward"] == 1.0


def test_loss_is_mean_nll_of_response_tokens_only(tiny_model, tiny_tokenizer):
    from rlvr.commands.sft import response_nll
    from rlvr.training.logprobs import get_response_log_probs
    from rlvr.training.tokenize import tokenize_prompt_and_output

    prompts = ["User: 2 + 3?\nAssistant: <think>", "A longer prompt here. User: 9?"]
    responses = [" 5 </think>", " 9 </think> <answer> 9 </answer>"]
    loss, n_tokens = sft_loss(tiny_model, tiny_tokenizer, prompts, responses)
    batch = tokenize_prompt_and_output(prompts, responses, tiny_tokenizer)
    lp = get_response_log_probs(tiny_model, batch["input_ids"], batch["labels"])["log_probs"]
    mask = batch["response_mask"]
    assert (
        n_tokens
        == int(mask.sum())
        == sum(len(tiny_tokenizer(r, add_special_tokens=False)["input_ids"]) for r in responses)
    )
    assert torch.allclose(loss, -lp[mask].sum() / n_tokens)

    # Changing the labels at prompt and padding positions leaves the loss and its gradient unchanged.
    scrambled = batch["labels"].clone()
    scrambled[~mask] = (scrambled[~mask] + 7) % len(tiny_tokenizer)
    assert not torch.equal(scrambled, batch["labels"])
    grads = []
    for labels in (batch["labels"], scrambled):
        tiny_model.zero_grad()
        value = response_nll(tiny_model, batch["input_ids"], labels, mask)
        value.backward()
        grads.append((value.detach(), [p.grad.clone() for p in tiny_model.parameters()]))
    assert torch.equal(grads[0][0], grads[1][0])
    assert all(torch.equal(a, b) for a, b in zip(grads[0][1], grads[1][1]))


def test_lr_schedule_hand_values():
    assert lr_factor(0, 100, "cosine", 10, 0.1) == pytest.approx(0.1)
    assert lr_factor(9, 100, "cosine", 10, 0.1) == pytest.approx(1.0)
    assert lr_factor(10, 100, "cosine", 10, 0.1) == pytest.approx(1.0)
    assert lr_factor(55, 100, "cosine", 10, 0.1) == pytest.approx(0.55)  # halfway through the cosine: (1 + 0.1) / 2
    assert lr_factor(100, 100, "cosine", 10, 0.1) == pytest.approx(0.1)
    # DPO's warmup then constant: 1/4, 2/4, 3/4, then the peak.
    assert [lr_factor(u, 100, "constant", 4, 0.0) for u in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_lr_schedule_steps_through_lr_factor():
    from rlvr.training.optim import lr_schedule

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    scheduler = lr_schedule(optimizer, 100, "cosine", 10, 0.1)
    seen = []
    for _ in range(12):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([2.0 * lr_factor(u, 100, "cosine", 10, 0.1) for u in range(12)])
    assert seen[:2] == pytest.approx([0.2, 0.4]) and seen[9:11] == pytest.approx([2.0, 2.0])


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft") / "ckpt"
    config = SFTConfig(
        data=TASK,
        model="tiny",
        out=out,
        steps=40,
        batch_size=16,
        lr=3e-3,
        warmup_steps=4,
        max_examples=400,
        progress=False,
        seed=0,
    )
    return config, run_sft(config)


def test_sft_lowers_response_loss_on_held_out(sft_run):
    from rlvr.modeling import fresh_model, load_model_and_tokenizer

    config, out = sft_run
    model, tokenizer = load_model_and_tokenizer(out)
    val = load_examples(TASK, "validation", limit=64)
    prompts, responses = sft_pairs(val)
    untrained = fresh_model("tiny", tokenizer, seed=config.seed)
    with torch.no_grad():
        before, _ = sft_loss(untrained, tokenizer, prompts, responses)
        after, _ = sft_loss(model, tokenizer, prompts, responses)
    assert after < 0.6 * before
    log = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in log] == list(range(1, 41)) and log[-1]["train/loss"] < log[0]["train/loss"]
    assert json.loads((out / "sft_config.json").read_text())["steps"] == 40


def test_checkpoint_reloads_with_identical_log_probs(sft_run, tmp_path):
    from rlvr.modeling import load_model_and_tokenizer, save_model_and_tokenizer
    from rlvr.training.logprobs import get_response_log_probs
    from rlvr.training.tokenize import tokenize_prompt_and_output

    _, out = sft_run
    model, tokenizer = load_model_and_tokenizer(out)
    again, tokenizer2 = load_model_and_tokenizer(save_model_and_tokenizer(model, tokenizer, tmp_path / "copy"))
    prompts, responses = sft_pairs(load_examples(TASK, "test", limit=8))
    batch = tokenize_prompt_and_output(prompts, responses, tokenizer)
    assert torch.equal(batch["input_ids"], tokenize_prompt_and_output(prompts, responses, tokenizer2)["input_ids"])
    with torch.no_grad():
        a = get_response_log_probs(model, batch["input_ids"], batch["labels"])["log_probs"]
        b = get_response_log_probs(again, batch["input_ids"], batch["labels"])["log_probs"]
    assert torch.equal(a, b)


def test_cli_parses_options(tmp_path):
    import tyro

    config = tyro.cli(
        SFTConfig,
        args=["--data", "arith:steps=3", "--model", "tiny", "--steps", "5", "--lr", "1e-4", "--out", str(tmp_path)],
    )
    assert (config.data, config.model, config.steps, config.lr) == ("arith:steps=3", "tiny", 5, 1e-4)


def test_unknown_model_is_a_clear_error(tmp_path):

    with pytest.raises(UserError, match="named size"):
        run_sft(SFTConfig(data=TASK, model="not-a-size", out=tmp_path, steps=1, max_examples=4, progress=False))


# --- the data options of rlvr train: a training config, the chat prompt, chat rows -----------------


def test_a_chat_pair_is_the_rendered_prompt_then_the_response_and_end_of_turn(tiny_tokenizer):
    from conftest import chat_tokenizer

    from rlvr.commands.sft import chat_pair_ids
    from rlvr.task.prompts import resolve_prompt

    tok = chat_tokenizer(tiny_tokenizer)
    example = Example("2+3?", "5", "2+3=5 </think> <answer> 5 </answer>")
    prompt_ids, response_ids = chat_pair_ids(tok, resolve_prompt("chat", system="Add.").bind(tok), example)
    ids = tok.convert_tokens_to_ids
    plain = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert prompt_ids == ids(["<|system|>"]) + plain("Add.") + ids(["<|end|>", "<|user|>"]) + plain("2+3?") + ids(
        ["<|end|>", "<|assistant|>"]
    )
    assert response_ids == plain("2+3=5 </think> <answer> 5 </answer>") + [tok.eos_token_id]


def test_sft_takes_the_data_and_prompt_of_a_training_config(tmp_path):
    from conftest import TOKEN_CHAT_TEMPLATE

    from rlvr.modeling import load_model_and_tokenizer

    (tmp_path / "chat.jinja").write_text(TOKEN_CHAT_TEMPLATE)
    (tmp_path / "grpo.yaml").write_text(
        "prompt: chat\n"
        "prompt_options: {system: Add the numbers.}\n"
        'data: {train_source: "arith:steps=1,max_value=9", train_size: 24}\n'
        "seed: 3\n"
    )
    common = dict(model="tiny", vocab_size=300, steps=3, batch_size=4, progress=False)
    with pytest.raises(UserError, match="sets the data and the prompt; leave out --data, --prompt"):
        run_sft(
            SFTConfig(config=tmp_path / "grpo.yaml", data="arith", prompt="question_only", out=tmp_path / "x", **common)
        )
    with pytest.raises(UserError, match="--prompt chat: a fresh model of size tiny .* pass --chat-template FILE"):
        run_sft(SFTConfig(config=tmp_path / "grpo.yaml", out=tmp_path / "y", **common))
    out = run_sft(
        SFTConfig(config=tmp_path / "grpo.yaml", chat_template=tmp_path / "chat.jinja", out=tmp_path / "sft", **common)
    )
    saved = json.loads((out / "sft_config.json").read_text())
    assert (saved["data"], saved["max_examples"], saved["prompt"], saved["system"], saved["data_seed"]) == (
        "arith:steps=1,max_value=9",
        24,
        "chat",
        "Add the numbers.",
        3,
    )
    _, tokenizer = load_model_and_tokenizer(out)
    assert tokenizer.chat_template == TOKEN_CHAT_TEMPLATE
    assert len(read_metrics(out / "metrics.jsonl")) == 3


def test_metrics_are_one_row_a_step_and_overwrite_starts_them_again(tmp_path):
    """``metrics.jsonl`` holds a row per step; ``--overwrite`` replaces an earlier fine-tune's rows
    instead of appending to them, and without it the earlier fine-tune is refused."""
    common = dict(data=TASK, model="tiny", vocab_size=300, batch_size=4, max_examples=16, out=tmp_path, progress=False)
    run_sft(SFTConfig(steps=3, **common))
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    with pytest.raises(UserError, match="--overwrite"):
        run_sft(SFTConfig(steps=2, **common))
    run_sft(SFTConfig(steps=2, overwrite=True, **common))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert set(rows[0]) >= {"train/loss", "lr", "train/grad_norm", "train/n_tokens"}


# --- the run scaffold: summary.json, Ctrl-C / SIGTERM save a checkpoint, --resume continues the run ---------


def _metric_rows(run_dir):
    return [{k: v for k, v in r.items() if k != "time"} for r in read_metrics(run_dir / "metrics.jsonl")]


def _same_weights(a, b) -> bool:
    from safetensors.torch import load_file

    x, y = load_file(str(a)), load_file(str(b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip() and "rlvr sft: warning: " not in line]
    assert len(lines) == 1 and lines[0].startswith("rlvr sft: "), err
    return lines[0]


# 10 examples in batches of 4: the data order runs across epochs, so a resume must carry what is left of it.
RESUME_SETTINGS = dict(steps=6, batch_size=4, max_examples=10, lr=3e-3, warmup_steps=2, vocab_size=300, save_every=2)


def _signal_at_call(monkeypatch, n: int, sig: int, out) -> list[str]:
    """Wrap ``rlvr.commands.sft.sft_loss`` so that each call records the run's summary status and the
    ``n``-th sends ``sig`` to this process (during that step); returns the recorded statuses."""
    import os

    import rlvr.commands.sft as sft

    statuses: list[str] = []
    original = sft.sft_loss

    def loss_then_signal(*args, **kwargs):
        statuses.append(json.loads((out / "summary.json").read_text())["status"])
        if len(statuses) == n:
            os.kill(os.getpid(), sig)
        return original(*args, **kwargs)

    monkeypatch.setattr(sft, "sft_loss", loss_then_signal)
    return statuses


def test_signal_saves_the_last_whole_step_and_resume_ends_as_the_uninterrupted_run(tmp_path, monkeypatch, capsys):
    import signal

    from rlvr.cli import main as cli

    straight = run_sft(SFTConfig(data=TASK, model="tiny", out=tmp_path / "straight", progress=False, **RESUME_SETTINGS))
    summary = json.loads((straight / "summary.json").read_text())
    assert (summary["status"], summary["step"], summary["n_steps"]) == ("finished", 6, 6)

    out = tmp_path / "stopped"
    argv = ["sft", "--data", TASK, "--model", "tiny", "--out", str(out), "--no-progress"]
    argv += [f"--{k.replace('_', '-')}={v}" for k, v in RESUME_SETTINGS.items()]
    resume = ["sft", "--resume", str(out), "--no-progress"]
    # SIGTERM in step 3 of the run, then Ctrl-C in step 5 (the second of the resumed run).
    for args, n, at_step, code, said in ((argv, 3, 3, 143, "stopped by SIGTERM"), (resume, 2, 5, 130, "interrupted")):
        statuses = _signal_at_call(monkeypatch, n, signal.SIGTERM if code == 143 else signal.SIGINT, out)
        assert cli(args) == code
        monkeypatch.undo()
        assert statuses == ["running"] * n
        summary = json.loads((out / "summary.json").read_text())
        assert (summary["status"], summary["step"], summary["last_checkpoint"]) == ("interrupted", at_step, at_step)
        assert f"{said}; saved a checkpoint at step {at_step}" in capsys.readouterr().err
        assert [r["step"] for r in _metric_rows(out)] == list(range(1, at_step + 1))
        assert [p.name for p in (out / "checkpoints").glob("step_*")] == [f"step_{at_step:06d}"]
        assert not (out / "model.safetensors").exists()

    # Run again without --resume: refused, nothing replaced; with it: the same run to its end.
    assert cli(argv) == 2
    assert "already holds results" in _one_line_error(capsys)
    assert cli(["sft", "--resume", str(out), "--no-progress"]) == 0
    assert json.loads((out / "summary.json").read_text())["status"] == "finished"
    assert _metric_rows(out) == _metric_rows(straight)
    assert _same_weights(straight / "model.safetensors", out / "model.safetensors")
    saved = json.loads((out / "sft_config.json").read_text())
    assert saved == json.loads((straight / "sft_config.json").read_text()) | {"out": str(out)}

    # sft_config.json edited by hand: refused, naming what differs from the checkpoint's own copy.
    (out / "sft_config.json").write_text(json.dumps({**saved, "lr": 0.5}))
    capsys.readouterr()
    assert cli(["sft", "--resume", str(out), "--steps", "8"]) == 2
    assert "cannot resume: lr in " in _one_line_error(capsys)


def test_a_weights_only_checkpoint_resumes_with_fresh_optimizer_on_the_same_data_order(tmp_path, monkeypatch, capsys):
    import signal

    from rlvr.cli import main as cli

    straight = run_sft(SFTConfig(data=TASK, model="tiny", out=tmp_path / "straight", progress=False, **RESUME_SETTINGS))
    out = tmp_path / "stopped"
    _signal_at_call(monkeypatch, 3, signal.SIGINT, out)
    with pytest.raises(KeyboardInterrupt):
        run_sft(SFTConfig(data=TASK, model="tiny", out=out, progress=False, **{**RESUME_SETTINGS, "save_every": 0}))
    monkeypatch.undo()
    (out / "checkpoints" / "step_000003" / "trainer_state.pt").unlink()
    capsys.readouterr()
    assert cli(["sft", "--resume", str(out), "--no-progress"]) == 2
    assert "--fresh-optimizer" in _one_line_error(capsys)
    assert cli(["sft", "--resume", str(out), "--no-progress", "--fresh-optimizer"]) == 0
    rows, expected = _metric_rows(out), _metric_rows(straight)
    assert [r["step"] for r in rows] == list(range(1, 7)) and rows[:3] == expected[:3]
    # The batches after the checkpoint are those of the uninterrupted run (their response token counts).
    assert [r["train/n_tokens"] for r in rows] == [r["train/n_tokens"] for r in expected]
    assert json.loads((out / "summary.json").read_text())["status"] == "finished"


def test_resume_of_a_directory_that_is_not_an_sft_run_is_one_line(tmp_path, capsys):
    from rlvr.cli import main as cli

    assert cli(["sft", "--resume", str(tmp_path / "missing")]) == 2
    assert "no such directory" in _one_line_error(capsys)
    assert cli(["sft", "--resume", str(tmp_path)]) == 2
    assert "sft_config.json is missing: is " in _one_line_error(capsys)
    (tmp_path / "sft_config.json").write_text(
        json.dumps({"command": "sft instruct", "data": "x.jsonl", "seq_length": 8})
    )
    assert cli(["sft", "--resume", str(tmp_path)]) == 2
    assert "an `rlvr sft` run directory?" in _one_line_error(capsys)
    assert cli(["sft", "--fresh-optimizer", "--out", str(tmp_path / "new")]) == 2
    assert "--fresh-optimizer applies to a resumed run" in _one_line_error(capsys)
