"""The synthetic ``arith`` task: determinism, disjoint splits, correct answers, knobs, r1_zero solutions."""

from __future__ import annotations

import re

import pytest

from rlvr.task.data import DataError, load_examples
from rlvr.task.generated import is_task_spec, load_task
from rlvr.task.generated.arithmetic import Problem, apply_op, load_arithmetic, split_of

TASK = "arith:steps=2,max_value=20"


def test_registered_and_loadable_through_data():
    assert is_task_spec("arith") and is_task_spec(TASK)
    for split in ("train", "validation", "test"):
        examples = load_examples(TASK, split=split, limit=50)
        assert len(examples) == 50
        assert all(ex.question and ex.ground_truth and ex.solution for ex in examples)


def test_string_knobs_equal_int_knobs():
    assert load_task("arith:steps=3,max_value=30", limit=20) == load_arithmetic(steps=3, max_value=30, limit=20)


def test_bad_knobs_raise_clear_errors():
    with pytest.raises(DataError, match="steps must be an integer"):
        load_task("arith:steps=two")
    with pytest.raises(DataError, match="ops"):
        load_task("arith:ops=*")
    with pytest.raises(DataError, match="unknown split"):
        load_task("arith", split="dev")
    with pytest.raises(ValueError, match="key=value"):
        load_task("arith:steps")


def test_deterministic_per_seed_and_prefix_stable():
    a = load_examples(TASK, "train", limit=100, seed=3)
    assert a == load_examples(TASK, "train", limit=100, seed=3)
    assert a[:40] == load_examples(TASK, "train", limit=40, seed=3)
    assert [ex.question for ex in a] != [ex.question for ex in load_examples(TASK, "train", limit=100, seed=4)]


def test_splits_are_disjoint():
    splits = {s: load_examples(TASK, s, limit=n) for s, n in (("train", 2000), ("validation", 300), ("test", 300))}
    texts = {s: [ex.question for ex in exs] for s, exs in splits.items()}
    for s in texts:
        assert len(set(texts[s])) == len(texts[s])  # no duplicates inside a split
        assert all(split_of(q) == s for q in texts[s])
    assert not set(texts["train"]) & set(texts["validation"])
    assert not set(texts["train"]) & set(texts["test"]) and not set(texts["validation"]) & set(texts["test"])
    # Disjoint whatever the seeds: the split is a function of the question alone.
    assert not set(texts["train"]) & {ex.question for ex in load_examples(TASK, "validation", limit=300, seed=7)}


def test_hand_worked_problem():
    p = Problem(7, (("+", 5), ("-", 3), ("*", 2), ("/", 3)))
    assert p.values() == [7, 12, 9, 18, 6] and p.answer == 6
    with pytest.raises(ValueError):
        apply_op(7, "/", 2)


def _numbers(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", text)]


@pytest.mark.parametrize("spec", [TASK, "arith:steps=4,max_value=50,ops=+-*/", "arith:steps=1,max_value=5"])
def test_answers_recomputed_from_structure_and_text(spec):
    for ex in load_examples(spec, "train", limit=200):
        start, ops = ex.meta["start"], [tuple(o) for o in ex.meta["ops"]]
        value = start
        for op, k in ops:
            value = apply_op(value, op, k)
        assert str(value) == ex.ground_truth
        # The question states the start and every operand, in order.
        assert _numbers(ex.question) == [start] + [k for _, k in ops]
        # Every written equation in the solution is arithmetically true and the chain ends at the answer.
        equations = re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)\.", ex.solution)
        assert len(equations) == len(ops)
        for a, op, b, c in equations:
            assert apply_op(int(a), op, int(b)) == int(c)
        assert equations[-1][3] == ex.ground_truth


def test_knobs_change_difficulty():
    easy = load_task("arith:steps=1,max_value=10", limit=300)
    hard = load_task("arith:steps=4,max_value=100", limit=300)
    assert all(len(ex.meta["ops"]) == 1 for ex in easy) and all(len(ex.meta["ops"]) == 4 for ex in hard)
    assert max(max(ex.meta["values"]) for ex in easy) <= 10
    assert max(max(ex.meta["values"]) for ex in hard) <= 100
    assert max(max(ex.meta["values"]) for ex in hard) > 50
    assert all(min(ex.meta["values"]) >= 1 for ex in hard)
    only_add = load_task("arith:steps=3,ops=+", limit=100)
    assert {op for ex in only_add for op, _ in ex.meta["ops"]} == {"+"}
    mixed = load_task("arith:steps=3,max_value=60,ops=+-*/", limit=400)
    assert {op for ex in mixed for op, _ in ex.meta["ops"]} == {"+", "-", "*", "/"}


def test_solutions_are_r1_zero_responses_graded_correct():
    from rlvr.task.grading import r1_zero_reward_fn
    from rlvr.task.prompts import render

    for ex in load_examples("arith:steps=3,max_value=40,ops=+-*/", "validation", limit=100):
        assert ex.solution.endswith(f" </think> <answer> {ex.ground_truth} </answer>")
        assert render("r1_zero", ex.question).endswith("Assistant: <think>")
        assert r1_zero_reward_fn(ex.solution, ex.ground_truth) == {
            "format_reward": 1.0,
            "answer_reward": 1.0,
            "reward": 1.0,
        }
        wrong = str(int(ex.ground_truth) + 1)
        assert (
            r1_zero_reward_fn(
                ex.solution.replace(f"<answer> {ex.ground_truth} <", f"<answer> {wrong} <"), ex.ground_truth
            )["reward"]
            == 0.0
        )


def test_noise_knobs_change_only_solutions():
    from rlvr.task.grading import r1_zero_reward_fn

    clean = load_examples("arith:steps=2,max_value=12", limit=300)
    slips = load_examples("arith:steps=2,max_value=12,noise=0.5", limit=300)
    near = load_examples("arith:steps=2,max_value=12,format_noise=0.5", limit=300)
    for other in (slips, near):
        assert [e.question for e in other] == [e.question for e in clean]
        assert [e.ground_truth for e in other] == [e.ground_truth for e in clean]
    slip_scores = [r1_zero_reward_fn(e.solution, e.ground_truth) for e in slips]
    near_scores = [r1_zero_reward_fn(e.solution, e.ground_truth) for e in near]
    wrong = sum(s["reward"] == 0 for s in slip_scores) / 300
    unformatted = sum(s["format_reward"] == 0 for s in near_scores) / 300
    assert 0.35 < wrong < 0.65 and all(s["format_reward"] == 1 for s in slip_scores)
    assert 0.35 < unformatted < 0.65
    # a near-miss solution is right in content: with the space restored it scores 1
    for e, s in zip(near, near_scores):
        if s["format_reward"] == 0:
            fixed = e.solution.replace("</think><answer>", "</think> <answer>")
            assert r1_zero_reward_fn(fixed, e.ground_truth)["reward"] == 1.0
    with pytest.raises(Exception, match="noise"):
        load_examples("arith:noise=1.5", limit=2)
