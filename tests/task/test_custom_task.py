"""A task of one's own, end to end: the word-sorting example of docs/custom_task.md (a chat prompt,
data with its own column names, a reward function from a file) trains two steps through ``rlvr train``
with ``engine.name: hf-fast`` on a tiny model of each family that engine runs, and ``rlvr eval`` runs
the same settings."""

from __future__ import annotations

import copy
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
from conftest import REPO, family_model

from rlvr.checks import resolve_config, validate_config
from rlvr.training.metrics_log import read_metrics

EXAMPLE = REPO / "examples" / "sort_words"
# A ChatML-like template: enough for the tiny tokenizer to render system, user and assistant turns.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# The example's config with a tiny model's sizes: two prompts of two samples, a few tokens each.
TINY = [
    "--engine.name",
    "hf-fast",
    "--engine.max_batch_size",
    "8",
    "--n_steps",
    "2",
    "--eval_every",
    "0",
    "--save_every",
    "0",
    "--dump_every",
    "1",
    "--rollout.n_prompts_per_rollout_batch",
    "2",
    "--rollout.group_size",
    "2",
    "--rollout.max_new_tokens",
    "6",
    "--optim.lr",
    "1e-3",
    "--optim.gradient_accumulation_steps",
    "1",
    "--data.train_size",
    "8",
    "--data.val_size",
    "2",
    "--log.no-progress",
    "--policy_device",
    "cpu",
]


@pytest.fixture(scope="module")
def chat_tokenizer(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def save_model(family: str, tokenizer, where: Path) -> Path:
    family_model(family, tokenizer).save_pretrained(where)
    tokenizer.save_pretrained(where)
    return where


def page_commands() -> dict[str, list[str]]:
    """The ``rlvr eval`` and ``rlvr train`` commands of docs/custom_task.md, as argument lists."""
    text = (REPO / "docs" / "custom_task.md").read_text(encoding="utf-8")
    commands = {}
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            if line.startswith("rlvr "):
                argv = shlex.split(line)[1:]
                commands[argv[0]] = argv
    assert set(commands) == {"eval", "train"}, "the page must show one rlvr eval and one rlvr train command"
    return commands


def with_values(argv: list[str], **values) -> list[str]:
    """``argv`` with the values of the flags named in ``values`` (``out="x"``: ``--out x``) replaced."""
    argv = list(argv)
    for flag, value in values.items():
        i = argv.index(f"--{flag}")
        argv[i + 1] = value
    return argv


@pytest.mark.parametrize(
    "family, data_format", [("llama", "jsonl"), ("qwen2", "parquet"), ("qwen3", "jsonl"), ("olmo2", "parquet")]
)
def test_example_task_trains_and_evaluates_on_each_family(family, data_format, chat_tokenizer, tmp_path, monkeypatch):
    """The page's two commands on a tiny model (``rlvr train`` with hf-fast and the tiny sizes)."""
    from rlvr.cli import main

    monkeypatch.chdir(REPO)  # the example's paths are relative to the repository root, as the page runs them
    commands = page_commands()
    model_dir = save_model(family, chat_tokenizer, tmp_path / "model")
    data = []
    if data_format == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = [json.loads(line) for line in (EXAMPLE / "train.jsonl").read_text().splitlines()[:8]]
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
        data = ["--data.train_source", str(tmp_path / "train.parquet")]
    run = tmp_path / "run"
    assert (
        main([*with_values(commands["train"], out=str(run)), "--model.name_or_path", str(model_dir), *TINY, *data]) == 0
    )
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert 0 <= r["train/reward"] <= 1 and r["train/reward/timeouts"] == 0
        assert 0 <= r["train/reward/same_words"] <= 1 and 0 <= r["train/reward/pairs_in_order"] <= 1
    assert "val/reward" in rows[-1] and "val/reward/same_words" in rows[-1]
    dumped = [json.loads(line) for line in (run / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert dumped[0]["prompt"].startswith("<|system|>\nSort the words") and dumped[0]["prompt"].endswith(
        "<|assistant|>\n"
    )
    assert "Sort these words alphabetically:" in dumped[0]["prompt"]

    out = tmp_path / "eval"
    assert (
        main(
            [
                *with_values(commands["eval"], model=str(model_dir), out=str(out)),
                "--limit",
                "2",
                "--max-tokens",
                "6",
                "--engine",
                "hf-fast",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    result = json.loads((out / "results.json").read_text())["results"]["chat"]
    k = int(commands["eval"][commands["eval"].index("--n") + 1])
    assert result["n"] == 2 * k and set(result["pass_at_k"]) >= {"1", str(k)} and "avg_at_k" in result
    assert set(result["rewards"]) == {"same_words", "pairs_in_order", "timeouts"}


def test_eval_flags_give_the_same_prompt_data_and_reward_as_the_config(chat_tokenizer, tmp_path, monkeypatch):
    """``rlvr eval`` with flags instead of ``--config``: the same prompts, ground truths and rewards."""
    from rlvr.cli import main

    monkeypatch.chdir(REPO)
    model_dir = save_model("qwen2", chat_tokenizer, tmp_path / "model")
    common = ["--model", str(model_dir), "--limit", "3", "--max-tokens", "4", "--device", "cpu", "--temperature", "0"]
    assert main(["eval", *common, "--config", str(EXAMPLE / "config.yaml"), "--out", str(tmp_path / "a")]) == 0
    system = (
        "Sort the words the user gives you. End your reply with one line 'Answer: ' followed by the sorted "
        "words, separated by spaces."
    )
    assert (
        main(
            [
                "eval",
                *common,
                "--out",
                str(tmp_path / "b"),
                "--prompt",
                "chat",
                "--system",
                system,
                "--data",
                str(EXAMPLE / "test.jsonl"),
                "--question-field",
                "task",
                "--answer-field",
                "sorted",
                "--answer-format",
                "raw",
                "--reward",
                "examples/sort_words/reward.py:sort_reward",
            ]
        )
        == 0
    )
    a, b = ([json.loads(x) for x in (tmp_path / d / "samples.jsonl").read_text().splitlines()] for d in "ab")
    keys = ("prompt", "ground_truth", "response", "reward", "same_words")
    assert [[s[k] for k in keys] for s in a] == [[s[k] for k in keys] for s in b]


def test_copying_the_example_elsewhere_works_with_paths_relative_to_the_run(chat_tokenizer, tmp_path, monkeypatch):
    """The page's first step: copy the folder and point the config at the copy."""
    shutil.copytree(EXAMPLE, tmp_path / "my_task")
    text = (tmp_path / "my_task" / "config.yaml").read_text().replace("examples/sort_words", "my_task")
    (tmp_path / "my_task" / "config.yaml").write_text(text)
    monkeypatch.chdir(tmp_path)
    from rlvr.config import load_config_file
    from rlvr.task.build import load_task_data, prepare_reward

    config = resolve_config(load_config_file("my_task/config.yaml"))
    validate_config(config)
    train, val = load_task_data(config)
    reward = prepare_reward(config, train)
    try:
        ex = train[0]
        assert reward(f"Answer: {ex.ground_truth}", ex.ground_truth, **ex.meta)["reward"] == 1.0
    finally:
        reward.close()


def test_eval_of_a_config_with_named_validation_sets(chat_tokenizer, tmp_path, monkeypatch):
    from rlvr.cli import main

    monkeypatch.chdir(REPO)
    model_dir = save_model("llama", chat_tokenizer, tmp_path / "model")
    text = (
        (EXAMPLE / "config.yaml")
        .read_text()
        .replace(
            "  val_source: examples/sort_words/test.jsonl\n",
            "  val_sources: ['held_out=examples/sort_words/test.jsonl', 'seen=examples/sort_words/train.jsonl size=3']\n",
        )
    )
    (tmp_path / "config.yaml").write_text(text)
    assert (
        main(
            [
                "eval",
                "--model",
                str(model_dir),
                "--config",
                str(tmp_path / "config.yaml"),
                "--out",
                str(tmp_path / "eval"),
                "--max-tokens",
                "4",
                "--device",
                "cpu",
                "--limit",
                "2",
            ]
        )
        == 0
    )
    results = json.loads((tmp_path / "eval" / "results.json").read_text())["results"]
    assert {name: m["n"] for name, m in results.items()} == {"held_out": 2, "seen": 2}
