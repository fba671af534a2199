"""The ``code`` reward and task: programs run in the sandbox against a row's tests; the shipped
problems' reference solutions pass their own tests; a tiny CPU run trains on the task."""

from __future__ import annotations

import json
import os

import pytest
from conftest import family_model

from rlvr import sandbox
from rlvr.task.code_reward import CodeTestsError, code_reward_fn, extract_program, parse_tests, same_output
from rlvr.task.data import DataError
from rlvr.task.generated import load_task
from rlvr.task.rewards import Reward, RewardConfigError, score_responses
from rlvr.training.metrics_log import read_metrics

needs_sandbox = pytest.mark.skipif(
    sandbox.isolation_problem() is not None, reason=f"no sandbox here: {sandbox.isolation_problem()}"
)
SUM_TESTS = json.dumps({"tests": [{"stdin": "2 3\n", "stdout": "5\n"}, {"stdin": "1 1\n", "stdout": "2\n"}]})


def fenced(program: str) -> str:
    return f"Here it is:\n```python\n{program}```\nDone."


def test_the_program_is_the_last_fenced_block():
    assert extract_program("```python\nprint(1)\n```\nor better\n```py\nprint(2)\n```") == "print(2)\n"
    assert extract_program("```\nprint(3)\n```") == "print(3)\n"
    assert extract_program("print(4)") is None
    assert extract_program("```python\nprint(5)\n") is None  # never closed


def test_output_is_compared_line_by_line_up_to_trailing_space():
    assert same_output("5  \n6\n\n", "5\n6")
    assert not same_output("5\n 6\n", "5\n6\n")
    assert not same_output("56\n", "5\n6\n")


def test_ground_truth_must_hold_tests():
    assert parse_tests(SUM_TESTS) == (json.loads(SUM_TESTS)["tests"], [])
    for bad in ("5", "{}", '{"tests": [{"stdin": 1}]}', '{"asserts": [3]}', "not json"):
        with pytest.raises(CodeTestsError, match="is not JSON with 'tests'"):
            parse_tests(bad)


def test_no_program_scores_zero_with_format_zero():
    assert code_reward_fn("print(5)", SUM_TESTS) == {
        "format_reward": 0.0,
        "answer_reward": 0.0,
        "reward": 0.0,
        "all_passed": 0.0,
        "test_timeouts": 0.0,
    }


@needs_sandbox
def test_pass_fraction_of_stdin_tests():
    right = code_reward_fn(fenced("a, b = map(int, input().split())\nprint(a + b)\n"), SUM_TESTS)
    assert right["reward"] == 1.0 and right["all_passed"] == 1.0
    # print(5) passes "2 3" and fails "1 1": one test of two.
    half = code_reward_fn(fenced("print(5)\n"), SUM_TESTS)
    assert half["reward"] == 0.5 and half["answer_reward"] == 0.5 and half["all_passed"] == 0.0
    crash = code_reward_fn(fenced("print(5)\nraise SystemExit(1)\n"), SUM_TESTS)
    assert crash["reward"] == 0.0 and crash["format_reward"] == 1.0


@needs_sandbox
def test_pass_fraction_of_assert_tests_and_early_exit():
    tests = json.dumps({"asserts": ["assert double(2) == 4", "assert double(0) == 0", "assert double(-3) == -6"]})
    # abs(2 * x) is right for 2 and 0, wrong for -3: two of three.
    assert code_reward_fn(fenced("def double(x):\n    return abs(2 * x)\n"), tests)["reward"] == pytest.approx(2 / 3)
    # Exiting before the asserts run passes none of them.
    early = fenced("import sys\ndef double(x):\n    return 2 * x\nsys.exit(0)\n")
    assert code_reward_fn(early, tests)["reward"] == 0.0


@needs_sandbox
def test_a_test_that_hangs_is_cut_off_and_counted(monkeypatch):
    monkeypatch.setattr("rlvr.task.code_reward.TEST_TIMEOUT_S", 0.5)
    tests = json.dumps({"tests": [{"stdin": "", "stdout": "1\n"}], "asserts": ["assert True"]})
    result = code_reward_fn(fenced("while True:\n    pass\n"), tests)
    assert result["reward"] == 0.0 and result["test_timeouts"] == 2.0


@needs_sandbox
def test_every_shipped_reference_solution_passes_its_tests_and_a_wrong_one_does_not():
    examples = load_task("code", split="train") + load_task("code", split="test")
    assert len(examples) == 18
    for example in examples:
        assert code_reward_fn(example.solution, example.ground_truth)["reward"] == 1.0, example.meta
    assert code_reward_fn(fenced("print('no')\n"), examples[0].ground_truth)["reward"] == 0.0


def test_task_splits_sizes_and_seeds():
    train, test = load_task("code", split="train"), load_task("code", split="test")
    assert len(train) == 12 and len(test) == 6
    assert not {e.meta["problem_id"] for e in train} & {e.meta["problem_id"] for e in test}
    assert load_task("code", split="validation") == test
    assert load_task("code:size=3", split="train", seed=1) == load_task("code", split="train", seed=1)[:3]
    assert all(e.question.endswith("```python ... ```.") for e in train)
    with pytest.raises(DataError, match="unknown split"):
        load_task("code", split="dev")
    with pytest.raises(DataError, match="no option steps"):
        load_task("code:steps=2")


@needs_sandbox
def test_reward_code_scores_through_the_trainers_path():
    reward = Reward(["code"])
    reward.start()
    ground_truths = [SUM_TESTS, SUM_TESTS]
    rewards, meta = score_responses(reward, [fenced("print(5)\n"), "no code"], ground_truths)
    assert rewards.tolist() == [0.5, 0.0]
    assert meta["logged"] == {"reward/all_passed": 0.0, "reward/test_timeouts": 0.0}
    assert meta["format_reward_mean"] == 0.5


def test_reward_code_is_refused_before_training_where_code_cannot_be_isolated():
    with sandbox.known_isolation_problem("user namespaces are switched off"):
        with pytest.raises(RewardConfigError, match="reward code cannot run on this machine: user namespaces"):
            Reward(["code"]).start()


def test_tiny_run_trains_on_the_code_task(tiny_tokenizer, tmp_path):
    """The pipeline on the code task: data, prompt, the code reward, two steps (a tiny random model
    writes no fenced program, so its rewards are 0; learning is not asked of it)."""
    from rlvr.cli import main

    model_dir = tmp_path / "model"
    family_model("qwen2", tiny_tokenizer).save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    run = tmp_path / "run"
    argv = ["train", "--model.name_or_path", str(model_dir), "--out", str(run), "--policy_device", "cpu"]
    argv += ["--data.train_source", "code", "--data.val_source", "code", "--data.val_size", "2"]
    argv += ["--reward.fn", "code", "--n_steps", "2", "--eval_every", "0", "--save_every", "0", "--log.no-progress"]
    argv += ["--rollout.n_prompts_per_rollout_batch", "2", "--rollout.group_size", "2"]
    argv += ["--rollout.max_new_tokens", "6", "--optim.gradient_accumulation_steps", "1"]
    assert main(argv) == 0
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert 0 <= r["train/reward"] <= 1 and "train/reward/all_passed" in r and "train/reward/test_timeouts" in r


def test_opting_out_of_isolation_where_the_kernel_has_none():
    with sandbox.known_isolation_problem("user namespaces are switched off"):
        reward = Reward(["code"], code_isolation=False)
        if os.getuid() == 0:
            # The sandbox never runs model-written code as root without namespaces: refused up front.
            with pytest.raises(RewardConfigError, match="switched off, and the trainer runs as root"):
                reward.start()
        else:
            reward.start()
            program = fenced("a, b = map(int, input().split())\nprint(a + b)\n")
            assert reward(program, SUM_TESTS)["reward"] == 1.0


@needs_sandbox
def test_opting_out_still_isolates_where_the_kernel_allows_it():
    reward = Reward(["code"], code_isolation=False)
    reward.start()
    code = "import socket\ntry:\n    socket.create_connection(('127.0.0.1', 9), timeout=1)\nexcept OSError as e:\n"
    code += "    print(e.errno)\n"
    tests = json.dumps({"tests": [{"stdin": "", "stdout": "101\n"}]})  # ENETUNREACH: no network at all
    assert reward(fenced(code), tests)["reward"] == 1.0
