"""The reward sees the row: user functions may take the rendered ``prompt``, its chat ``messages``
and any column by keyword; functions written for ``(response, ground_truth, **fields)`` or with
named columns only keep working."""

from __future__ import annotations

import textwrap

import pytest

from rlvr.task.prompts import resolve_prompt
from rlvr.task.rewards import Reward, RewardConfigError, row_fields, score_responses

ROW_REWARDS = textwrap.dedent("""
    def asks_prompt(response, ground_truth, prompt, messages):
        return {"reward": float(prompt.endswith("?") and messages[-1]["role"] == "user"), "turns": len(messages)}

    def asks_column(response, ground_truth, level):
        return float(level == "hard")

    def takes_everything(response, ground_truth, **fields):
        return {"reward": 1.0, "names": len(fields), "has_prompt": float("prompt" in fields)}

    def needs_missing(response, ground_truth, difficulty):
        return 1.0
""")


@pytest.fixture()
def row_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "row_rewards.py").write_text(ROW_REWARDS)
    return "row_rewards.py"


def score(spec: str, fields: list[dict]) -> dict:
    reward = Reward([spec])
    reward.start(sorted(set(fields[0]) - {"prompt", "messages"}))
    try:
        return score_responses(reward, ["r"] * len(fields), ["g"] * len(fields), fields)[1]
    finally:
        reward.close()


def test_row_fields_put_the_prompt_and_messages_beside_the_columns_which_win():
    messages = [{"role": "user", "content": "q?"}]
    assert row_fields({"level": "hard"}, "q?", messages) == {"prompt": "q?", "messages": messages, "level": "hard"}
    assert row_fields({"prompt": "column"}, "rendered", messages)["prompt"] == "column"


def test_messages_of_a_text_template_and_of_a_chat_prompt():
    template = resolve_prompt("question_only")
    assert template.messages("2+2?") == [{"role": "user", "content": template.render("2+2?")}]
    chat = resolve_prompt("chat", system="Be brief.", user_template="Q: {question}")
    assert chat.messages("2+2?") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Q: 2+2?"},
    ]


def test_a_function_may_take_the_prompt_and_messages(row_file):
    fields = [row_fields({}, "What is 2+2?", [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])]
    meta = score(f"{row_file}:asks_prompt", fields)
    assert meta["scores"][0]["reward"] == 1.0 and meta["logged"]["reward/turns"] == 2.0


def test_old_signatures_keep_working(row_file):
    fields = [row_fields({"level": "hard"}, "p?", []), row_fields({"level": "easy"}, "p?", [])]
    assert [s["reward"] for s in score(f"{row_file}:asks_column", fields)["scores"]] == [1.0, 0.0]
    everything = score(f"{row_file}:takes_everything", fields)["scores"][0]
    assert everything["names"] == 3.0 and everything["has_prompt"] == 1.0


def test_a_column_the_data_lacks_is_still_refused_before_training(row_file):
    reward = Reward([f"{row_file}:needs_missing"])
    with pytest.raises(RewardConfigError, match="cannot be called as fn"):
        reward.start(["level"])
    reward.close()


def test_training_and_validation_pass_the_prompt_and_messages(row_file, tiny_tokenizer, tmp_path):
    from conftest import family_model

    from rlvr.cli import main
    from rlvr.training.metrics_log import read_metrics

    model_dir = tmp_path / "model"
    family_model("qwen2", tiny_tokenizer).save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    argv = ["train", "--model.name_or_path", str(model_dir), "--out", str(tmp_path / "run"), "--policy_device", "cpu"]
    argv += ["--data.train_source", "arith:steps=1", "--data.val_source", "arith:steps=1", "--data.val_size", "2"]
    argv += ["--reward.fn", f"{row_file}:takes_everything", "--n_steps", "1", "--eval_every", "1", "--save_every", "0"]
    argv += ["--rollout.n_prompts_per_rollout_batch", "2", "--rollout.group_size", "2", "--log.no-progress"]
    argv += ["--rollout.max_new_tokens", "4", "--optim.gradient_accumulation_steps", "1"]
    assert main(argv) == 0
    last = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    assert last["train/reward/has_prompt"] == 1.0 and last["val/reward/has_prompt"] == 1.0
