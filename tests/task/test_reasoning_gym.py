"""``reasoning_gym:<task>`` sources and the ``reasoning_gym`` reward, on the real package (offline):
options reach the generator, splits and seeds give separate streams, the reward is the generator's
own scorer, and a tiny CPU run trains and evaluates on a task end to end."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import family_model

from rlvr.task.data import DataError
from rlvr.task.generated import load_task
from rlvr.task.generated.reasoning_gym_tasks import dataset, reasoning_gym_reward_fn, unavailable
from rlvr.task.rewards import Reward, RewardConfigError, row_fields

pytest.importorskip("reasoning_gym")

ARITHMETIC = "reasoning_gym:basic_arithmetic"


def config_of(example) -> dict:
    return json.loads(example.fields["rg_config"])


def test_size_seed_and_splits():
    train = load_task(f"{ARITHMETIC},size=6", split="train", seed=0)
    assert len(train) == 6 and [e.fields["rg_index"] for e in train] == list(range(6))
    assert load_task(f"{ARITHMETIC},size=6", split="train", seed=0) == train
    assert load_task(ARITHMETIC, split="train", seed=0, limit=3) == train[:3]
    other_seed = load_task(f"{ARITHMETIC},size=6", split="train", seed=1)
    validation = load_task(f"{ARITHMETIC},size=6", split="validation", seed=0)
    assert config_of(other_seed[0])["seed"] != config_of(train[0])["seed"] != config_of(validation[0])["seed"]
    assert [e.question for e in validation] != [e.question for e in train]


def test_difficulty_is_the_curriculum_level_and_options_set_fields():
    easiest = load_task(f"{ARITHMETIC},size=4,difficulty=0", split="train")
    # Level 0 of basic_arithmetic's curriculum: two terms of one digit each.
    assert {(config_of(e)["min_terms"], config_of(e)["max_terms"], config_of(e)["max_digits"]) for e in easiest} == {
        (2, 2, 1)
    }
    assert all(
        len([t for t in e.question.removeprefix("Calculate ").split() if t.strip("-().").isdigit()]) == 2
        for e in easiest
    )
    three = load_task(f"{ARITHMETIC},size=2,difficulty=0,max_terms=3,allow_parentheses=false", split="train")
    assert config_of(three[0])["max_terms"] == 3 and config_of(three[0])["allow_parentheses"] is False


@pytest.mark.parametrize(
    "source, message",
    [
        ("reasoning_gym:no_such_task", "has no task 'no_such_task'; its tasks: "),
        (f"{ARITHMETIC},colour=red", "has no option colour; its options are size, difficulty, min_terms"),
        (f"{ARITHMETIC},max_terms=many", "option max_terms='many' is not a int"),
        ("reasoning_gym", "name the generator: reasoning_gym:<task>"),
    ],
)
def test_bad_sources_are_one_line_with_the_fix(source, message):
    with pytest.raises(DataError, match=message.replace("(", r"\(")):
        load_task(source)


def test_the_reward_is_the_generators_own_score():
    examples = load_task(f"{ARITHMETIC},size=3", split="test")
    data = dataset(examples[0].fields["rg_task"], examples[0].fields["rg_config"])
    for example in examples:
        entry = data[example.fields["rg_index"]]
        assert entry["question"] == example.question and str(entry["answer"]) == example.ground_truth
        right = reasoning_gym_reward_fn(
            f"<think>...</think> <answer> {example.ground_truth} </answer>", "", **example.fields
        )
        assert right["reward"] == data.score_answer(answer=example.ground_truth, entry=entry) == 1.0
        boxed = reasoning_gym_reward_fn(f"so \\boxed{{{example.ground_truth}}}", "", **example.fields)
        assert boxed["reward"] == 1.0
        wrong = reasoning_gym_reward_fn("<answer>123456789</answer>", "", **example.fields)
        assert wrong["reward"] == data.score_answer(answer="123456789", entry=entry) == 0.0
    with pytest.raises(DataError, match="scores examples of a reasoning_gym:<task> source"):
        reasoning_gym_reward_fn("<answer>1</answer>", "1", words=["a"])


def test_the_reward_by_name_gets_the_rows_fields():
    examples = load_task(f"{ARITHMETIC},size=2", split="train")
    reward = Reward(["reasoning_gym"], workers=2)
    reward.start()
    scores = reward.score_batch(
        [f"<answer>{examples[0].ground_truth}</answer>", "<answer>nothing</answer>"],
        [e.ground_truth for e in examples],
        [row_fields(e.fields, "p", []) for e in examples],
    )
    assert [s["reward"] for s in scores] == [1.0, 0.0]


def test_without_the_package_the_reward_is_refused_before_training(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # what an environment without it imports
    assert "pip install 'rlvr[reasoning-gym]'" in unavailable()
    with pytest.raises(RewardConfigError, match="reward reasoning_gym cannot run on this machine: .*pip install"):
        Reward(["reasoning_gym"]).start()
    with pytest.raises(DataError, match="pip install"):
        load_task(ARITHMETIC)


def test_tiny_run_trains_and_evaluates_on_a_reasoning_gym_task(tiny_tokenizer, tmp_path):
    """The pipeline (learning is not asked of a tiny random model): two training steps with
    validation, then ``rlvr eval`` on the same source and reward."""
    from rlvr.cli import main
    from rlvr.training.metrics_log import read_metrics

    model_dir = tmp_path / "model"
    family_model("qwen2", tiny_tokenizer).save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    source = f"{ARITHMETIC},difficulty=0"
    run = tmp_path / "run"
    argv = ["train", "--model.name_or_path", str(model_dir), "--out", str(run), "--policy_device", "cpu"]
    argv += ["--data.train_source", source, "--data.val_source", source, "--data.val_size", "2"]
    argv += ["--reward.fn", "reasoning_gym", "--n_steps", "2", "--eval_every", "2", "--save_every", "0"]
    argv += ["--rollout.n_prompts_per_rollout_batch", "2", "--rollout.group_size", "2", "--log.no-progress"]
    argv += ["--rollout.max_new_tokens", "4", "--optim.gradient_accumulation_steps", "1"]
    assert main(argv) == 0
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(0 <= r["train/reward"] <= 1 for r in rows[1:]) and 0 <= rows[-1]["val/reward"] <= 1

    out = tmp_path / "eval"
    argv = ["eval", "--model", str(model_dir), "--data", source, "--reward", "reasoning_gym", "--limit", "2"]
    argv += ["--max-tokens", "4", "--device", "cpu", "--out", str(out)]
    assert main(argv) == 0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 and all(s["reward"] in (0.0, 1.0) for s in samples)
