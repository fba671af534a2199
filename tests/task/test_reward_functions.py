"""Rewards from config: the built-ins by name, user functions (a file or a module) in a worker with a
time bound, extra numbers logged, weighted sums, and one-line errors for settings that cannot work."""

from __future__ import annotations

import textwrap
import time

import pytest

from rlvr.task import grading
from rlvr.task.rewards import (
    BUILTIN_REWARDS,
    Reward,
    RewardConfigError,
    RewardFunctionError,
    build_reward,
    score_responses,
    spec_problem,
)

USER_REWARDS = textwrap.dedent("""
    import time

    def length_bonus(response, ground_truth, **fields):
        return {"reward": float(response.strip() == ground_truth), "length": len(response), "lang": fields.get("lang")}

    def plain(response, ground_truth, **fields):
        return 0.5

    def slow(response, ground_truth, **fields):
        if response == "hang":
            time.sleep(60)
        return 1.0

    def broken(response, ground_truth, **fields):
        raise KeyError("no such thing")

    def no_fields(response, ground_truth):
        return 1.0

    def not_a_reward(response, ground_truth, **fields):
        return "yes"
""")


@pytest.fixture()
def user_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_rewards.py").write_text(USER_REWARDS)
    return "my_rewards.py"


def test_builtins_by_name():
    assert BUILTIN_REWARDS["r1_zero"] is grading.r1_zero_reward_fn
    assert BUILTIN_REWARDS["question_only"] is grading.question_only_reward_fn
    boxed, exact = BUILTIN_REWARDS["boxed"], BUILTIN_REWARDS["exact"]
    assert boxed("so \\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}")["reward"] == 1.0
    assert boxed("so \\boxed{[1,2)}", "[1,2)")["reward"] == 1.0 and boxed("\\boxed{(1,2)}", "[1,2)")["reward"] == 0.0
    assert boxed("\\boxed{18.0001}", "18")["reward"] == 0.0 and boxed("no box", "18")["format_reward"] == 0.0
    assert exact("thinking... <answer> Paris  </answer>", "Paris")["reward"] == 1.0
    assert exact("\\boxed{paris}", "Paris")["reward"] == 0.0 and exact("Paris", "Paris")["reward"] == 1.0


def test_a_file_function_gets_the_fields_and_its_extra_numbers_are_logged(user_file):
    reward = build_reward(f"{user_file}:length_bonus")
    try:
        reward.start(["lang"])
        raw, meta = score_responses(reward, ["42", "41 "], ["42", "42"], [{"lang": "en"}, {"lang": "fr"}])
    finally:
        reward.close()
    assert raw.tolist() == [1.0, 0.0]
    assert meta["logged"] == {"reward/length": 2.5, "reward/timeouts": 0.0}  # text fields are not numbers to log
    assert meta["format_reward_mean"] == 1.0 and meta["answer_reward_mean"] == 0.5


def test_a_module_function_and_a_weighted_sum(user_file):
    reward = Reward(["my_rewards:plain", "exact"], [2.0, 1.0])
    try:
        reward.start()
        r = reward("<answer>7</answer>", "7")
    finally:
        reward.close()
    assert r["reward"] == 2.0 * 0.5 + 1.0 and r["plain"] == 0.5 and r["exact"] == 1.0


def test_a_hanging_call_is_cut_off_scored_zero_and_counted(user_file):
    reward = build_reward(f"{user_file}:slow", timeout_s=0.5)
    try:
        reward.start()
        t0 = time.monotonic()
        raw, meta = score_responses(reward, ["fine", "hang", "fine"], ["x"] * 3)
        assert time.monotonic() - t0 < 20
    finally:
        reward.close()
    assert raw.tolist() == [1.0, 0.0, 1.0]  # the worker restarts after the cut-off call
    assert meta["logged"]["reward/timeouts"] == 1.0


def test_a_function_that_raises_or_returns_no_reward_stops_with_its_message(user_file):
    for name, message in [("broken", "raised KeyError: 'no such thing'"), ("not_a_reward", "returned str 'yes'")]:
        reward = build_reward(f"{user_file}:{name}")
        try:
            with pytest.raises(RewardFunctionError, match=message):
                reward("r", "g")
        finally:
            reward.close()


def test_bad_specs_are_named_with_the_fix(user_file):
    assert spec_problem("exact") is None and spec_problem("my_rewards:plain") is None
    assert "no such file nope.py" in spec_problem("nope.py:f")
    hint = "is not a reward function: name a built-in (r1_zero, question_only, boxed, exact, code, reasoning_gym)"
    assert hint in spec_problem("boxd")
    with pytest.raises(
        RewardConfigError,
        match=r"my_rewards.py has no function 'missing' \(functions there: broken, "
        r"length_bonus, no_fields, not_a_reward, plain, slow\)",
    ):
        build_reward(f"{user_file}:missing").start()
    with pytest.raises(RewardConfigError, match="importing module no_such_module failed: ModuleNotFoundError"):
        build_reward("no_such_module:f").start()
    with pytest.raises(RewardConfigError, match=r"cannot be called .* \(lang\): .*give it a \*\*fields parameter"):
        build_reward(f"{user_file}:no_fields").start(["lang"])
    with pytest.raises(RewardConfigError, match="reward.fn .* or reward.fns .*not both"):
        build_reward("exact", ["boxed"])
    with pytest.raises(RewardConfigError, match="reward.weights has 1 numbers for 2 reward.fns"):
        build_reward(None, ["exact", "boxed"], [1.0])


def test_a_function_cut_off_on_every_call_stops_the_run(user_file, monkeypatch):
    import rlvr.task.rewards as rf

    monkeypatch.setattr(rf, "TIMEOUTS_IN_A_ROW_LIMIT", 3)
    reward = build_reward(f"{user_file}:slow", timeout_s=0.2)
    try:
        assert reward("hang", "x")["timed_out"] == 1.0 and reward("fine", "x")["reward"] == 1.0  # the count resets
        reward("hang", "x"), reward("hang", "x")
        with pytest.raises(RewardFunctionError, match=r"took longer than reward.timeout_s=0.2 s on 3 calls in a row"):
            reward("hang", "x")
    finally:
        reward.close()


def test_the_trainer_stops_with_the_reward_functions_message(
    gsm8k_path, tiny_model, tiny_tokenizer, tmp_path, user_file
):
    from test_trainer import tiny_config

    from rlvr.commands.train import GraderError, train
    from rlvr.config import RewardConfig

    cfg = tiny_config(gsm8k_path, reward=RewardConfig(fn=f"{user_file}:broken"), eval_at_start=False)
    with pytest.raises(
        GraderError,
        match=r"the reward function failed at step 1: RewardFunctionError: .*broken' "
        r"raised KeyError: 'no such thing'",
    ):
        train(cfg, tmp_path / "run", model=tiny_model, tokenizer=tiny_tokenizer)
