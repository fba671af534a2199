"""Reward functions and the grader: the format rule to the letter, every written form, no false accepts."""

from __future__ import annotations

import random
import threading

import pytest

from rlvr.task import grading
from rlvr.task.grading import grade, last_boxed, question_only_reward_fn, r1_zero_reward_fn

ZERO = {"format_reward": 0.0, "answer_reward": 0.0, "reward": 0.0}
FORMAT_ONLY = {"format_reward": 1.0, "answer_reward": 0.0, "reward": 0.0}
CORRECT = {"format_reward": 1.0, "answer_reward": 1.0, "reward": 1.0}


def r1(answer: str, think: str = "2 * 9 = 18") -> str:
    return f"{think} </think> <answer>{answer}</answer>"


@pytest.fixture
def no_symbolic():
    """Fail the test if the symbolic (math-verify) path is reached; yields the number of answers that
    reached it since the test began."""
    before = grading.symbolic_checks()

    def reached() -> int:
        return grading.symbolic_checks() - before

    yield reached
    assert reached() == 0, f"{reached()} answers went to the symbolic grader"


# --- the r1_zero format rule -------------------------------------------------------------------


@pytest.mark.parametrize(
    "response, expected",
    [
        ("We add. </think> <answer>18</answer>", CORRECT),
        ("We add. </think> <answer> 18 </answer>", CORRECT),
        ("We add. </think> <answer>19</answer>", FORMAT_ONLY),
        # the literal "</think> <answer>" needs exactly one space
        ("We add. </think><answer>18</answer>", ZERO),
        ("We add. </think>  <answer>18</answer>", ZERO),
        ("We add. </think>\n<answer>18</answer>", ZERO),
        # "</answer>" must be present
        ("We add. </think> <answer>18", ZERO),
        ("We add. </think> <answer>18</answer", ZERO),
        # no think close at all
        ("<answer>18</answer>", ZERO),
        ("18", ZERO),
        ("", ZERO),
        # the last <answer> block is the answer
        ("</think> <answer>19</answer> wait <answer>18</answer>", CORRECT),
        ("</think> <answer>18</answer> wait <answer>19</answer>", FORMAT_ONLY),
        # a \boxed inside the answer: the content of the last box
        (r"</think> <answer>\boxed{18}</answer>", CORRECT),
        (r"</think> <answer>The answer is \boxed{18}.</answer>", CORRECT),
        (r"</think> <answer>\boxed{19} no, \boxed{18}</answer>", CORRECT),
        (r"</think> <answer>\boxed{18} no, \boxed{19}</answer>", FORMAT_ONLY),
        (r"</think> <answer>\boxed{\frac{36}{2}}</answer>", CORRECT),
        # a \boxed with nothing parseable: format 1, answer 0
        (r"</think> <answer>\boxed{}</answer>", FORMAT_ONLY),
        (r"</think> <answer>\boxed{18</answer>", FORMAT_ONLY),
        (r"</think> <answer>\boxed</answer>", FORMAT_ONLY),
        # empty answer: formatted, wrong
        ("</think> <answer></answer>", FORMAT_ONLY),
        ("</think> <answer> </answer>", FORMAT_ONLY),
    ],
)
def test_r1_zero_format_rule(response, expected):
    assert r1_zero_reward_fn(response, "18") == expected


def test_r1_zero_reward_values_are_floats_and_reward_equals_answer_reward():
    for response in [r1("18"), r1("19"), "no tags"]:
        out = r1_zero_reward_fn(response, "18")
        assert set(out) == {"format_reward", "answer_reward", "reward"}
        assert all(type(v) is float and v in (0.0, 1.0) for v in out.values())
        assert out["reward"] == out["answer_reward"]


def test_r1_zero_text_after_answer_close_is_part_of_the_answer():
    # The protocol: the text after the last <answer> with "</answer>" removed; a stray number after it counts
    assert r1_zero_reward_fn("</think> <answer>18</answer> or 19", "18") == FORMAT_ONLY
    assert r1_zero_reward_fn("</think> <answer>18</answer>\n", "18") == CORRECT


def test_r1_zero_with_the_prompt_prefix_style_response():
    response = " Natalia sold 48/2 = 24 clips in May. Altogether 48+24 = 72. </think> <answer> 72 </answer>"
    assert r1_zero_reward_fn(response, "72") == CORRECT
    assert r1_zero_reward_fn(response, "24") == FORMAT_ONLY


# --- question_only -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        (r"So the total is \boxed{18}.", "18", CORRECT),
        (r"So the total is \boxed{19}.", "18", FORMAT_ONLY),
        (r"Half is \boxed{\frac{1}{2}}", "0.5", CORRECT),
        (r"\boxed{\dfrac{36}{2}}", "18", CORRECT),
        (r"\boxed{\text{18 dollars}}", "18", CORRECT),
        (r"First \boxed{19}, corrected: \boxed{18}", "18", CORRECT),
        (r"First \boxed{18}, corrected: \boxed{19}", "18", FORMAT_ONLY),
        (r"\boxed{2,125}", "2,125", CORRECT),
        ("The answer is 18.", "18", ZERO),
        ("</think> <answer>18</answer>", "18", ZERO),
        (r"\boxed{}", "18", FORMAT_ONLY),
        (r"\boxed{18", "18", ZERO),
    ],
)
def test_question_only_reward(response, truth, expected):
    assert question_only_reward_fn(response, truth) == expected


@pytest.mark.parametrize(
    "text, content",
    [
        (r"\boxed{18}", "18"),
        (r"a \boxed{1} b \boxed{2} c", "2"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{\sqrt{2}}{2}"),
        (r"\boxed 18", "18"),
        (r"\boxed{}", ""),
        (r"\boxed{18", None),
        ("18", None),
    ],
)
def test_last_boxed(text, content):
    assert last_boxed(text) == content


# --- grading: every accepted written form ------------------------------------------------------


@pytest.mark.parametrize(
    "answer, truth",
    [
        ("18", "18"),
        (" 18 ", "18"),
        ("\n18\n", "18"),
        ("2,125", "2125"),
        ("2125", "2,125"),
        ("2,125", "2,125"),
        ("1,234,567", "1234567"),
        ("$18", "18"),
        (r"\$18", "18"),
        ("$18$", "18"),
        ("18$", "18"),
        ("18.0", "18"),
        ("18.00", "18"),
        (r"\$18.00", "18"),
        ("$2,125.00", "2125"),
        ("18%", "18"),
        (r"18\%", "18"),
        ("18 percent", "18"),
        (r"18\text{ dollars}", "18"),
        (r"18 \text{dollars}", "18"),
        (r"\text{18 apples}", "18"),
        (r"\textbf{18}", "18"),
        (r"18\,\mathrm{cm}", "18"),
        ("18 dollars", "18"),
        ("18 apples", "18"),
        ("18 miles per hour", "18"),
        ("18cm", "18"),
        ("18 kg", "18"),
        ("x = 18", "18"),
        ("x=18", "18"),
        ("The total = 18", "18"),
        ("The answer is 18.", "18"),
        ("The answer is 18", "18"),
        ("Answer: 18", "18"),
        ("John has 18 apples left.", "18"),
        ("**18**", "18"),
        ("The answer is **18**.", "18"),
        (r"\boxed{18}", "18"),
        (r"\frac{36}{2}", "18"),
        (r"\dfrac{36}{2}", "18"),
        (r"\tfrac{36}{2}", "18"),
        (r"\frac{1}{2}", "0.5"),
        (r"\frac12", "0.5"),
        ("0.5", "1/2"),
        ("1/2", "0.5"),
        (".5", "0.5"),
        ("2/4", "0.5"),
        ("36/2", "18"),
        ("2 * 9", "18"),
        (r"2 \times 9", "18"),
        (r"6 \cdot 3", "18"),
        ("20 - 2", "18"),
        ("(18)", "18"),
        ("3^2 * 2", "18"),
        ("36/2 = 18", "18"),
        ("18 = 18", "18"),
        ("18 apples. So 18.", "18"),
        ("-18", "-18"),
        ("\u221218", "-18"),
        ("x = -18", "-18"),
        ("$-18", "-18"),
        ("-$18", "-18"),
        ("+18", "18"),
        ("018", "18"),
        ("18.50", "18.5"),
        ("0", "0"),
        ("John\u2019s total is 18", "18"),
        (r"$18$ \text{ dollars}", "18"),
        ("18^\\circ", "18"),
    ],
)
def test_grade_accepts(answer, truth, no_symbolic):
    assert grade(answer, truth) is True
    assert no_symbolic() == 0


# --- grading: rejections -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "answer, truth",
    [
        ("", "18"),
        ("   ", "18"),
        ("$", "18"),
        (r"\text{dollars}", "18"),
        ("eighteen", "18"),
        ("18 or 19", "18"),
        ("18 or 18.5", "18"),
        ("19 or 18", "18"),
        ("18 and 19", "18"),
        (r"18 \text{ or } 19", "18"),
        ("either 18 or 19", "18"),
        ("18 or so", "18"),
        (r"\not 18", "18"),
        (r"18, \ldots", "18"),
        (r"\sqrt{324} \text{ or } 19", "18"),
        ("18, 19", "18"),
        ("18,19", "18"),
        ("18 19", "18"),
        ("18; 19", "18"),
        ("18\n19", "18"),
        ("18 apples and 3 pears", "18"),
        ("18 apples, 3 pears", "18"),
        ("He had 18 then 19", "18"),
        ("x = 18, y = 19", "18"),
        ("-18", "18"),
        ("18", "-18"),
        ("negative 18", "18"),
        ("--18", "18"),
        ("+-18", "-18"),
        ("minus 18", "-18"),
        ("18.5", "18"),
        ("18.01", "18"),
        ("180", "18"),
        ("1.8", "18"),
        ("18,000", "18"),
        ("18000", "18"),
        ("81", "18"),
        ("about 18", "18"),
        ("approximately 18", "18"),
        (r"\approx 18", "18"),
        ("~18", "18"),
        ("at least 18", "18"),
        ("more than 18", "18"),
        ("not 18", "18"),
        ("18 thousand", "18000"),
        ("18k", "18000"),
        ("18 million", "18000000"),
        ("18 dozen", "216"),
        ("half of 36", "18"),
        (r"18 \pm 1", "18"),
        ("18 \u00b1 1", "18"),
        ("18 < x", "18"),
        ("18!", "18"),
        ("2x", "18"),
        ("2x = 36", "18"),
        ("1e1", "10"),
        ("36/2 = 19", "19"),
        ("36/2 = 19", "18"),
        ("18-19 apples", "-1"),
        ("18.0.0", "18"),
        ("(18", "18"),
        ("18/0", "18"),
        (r"\{18\}", "18"),
        ("18 apples\n\nThe answer is 19", "19"),
        (r"\boxed{}", "18"),
        (r"\boxed{19}", "18"),
        ("18", ""),
    ],
)
def test_grade_rejects(answer, truth):
    assert grade(answer, truth) is False


# --- the symbolic fallback (math-verify in a worker process) -----------------------------------


def test_symbolic_forms_go_through_math_verify():
    before = grading.symbolic_checks()
    assert grade(r"\sqrt{324}", "18") is True
    assert grading.symbolic_checks() == before + 1
    assert grade(r"3\sqrt{36}", "18") is True
    assert grade(r"\frac{\sqrt{4}}{2}", "1") is True
    assert grade(r"\sqrt{325}", "18") is False
    assert grade(r"2\pi", "6") is False
    # math-verify rounds to 6 digits; we demand exact equality
    assert grade(r"\sqrt{324.0000001}", "18") is False
    # juxtaposed numbers would be multiplied by math-verify; we reject them
    assert grade(r"\sqrt{4} 9", "18") is False


def test_numeric_answers_never_reach_the_symbolic_path(no_symbolic):
    rng = random.Random(0)
    forms = ["{}", "${}", "{} dollars", "x = {}", "The answer is {}.", r"\boxed{{{}}}", "{}.00", "{} or {}"]
    for _ in range(1000):
        truth = str(rng.randint(-5000, 5000))
        form = rng.choice(forms)
        r1_zero_reward_fn(r1(form.format(truth, truth)), truth)
        r1_zero_reward_fn(r1(form.format(rng.randint(0, 9), truth)), truth)
    assert no_symbolic() == 0


@pytest.mark.parametrize(
    "answer",
    [
        "9^9^9^9",
        "9^{9^{9^{9}}}",
        "9**9**9**9",
        r"\sqrt{9^{9^{9^{9}}}}",  # short enough for math-verify, which hangs on it: the timeout scores 0
        r"\frac{" * 3000 + "1" + "}{2}" * 3000,
        "1" * 10000,
        "(" * 500 + "18" + ")" * 500,
        r"\sqrt{" * 60 + "18" + "}" * 60,
    ],
)
def test_pathological_answers_score_zero(answer):
    assert grade(answer, "18") is False
    assert r1_zero_reward_fn(r1(answer), "18") == FORMAT_ONLY


def test_symbolic_grading_from_a_worker_thread_and_after_a_timeout():
    results = {}

    def work():
        results["hang"] = grade(r"\sqrt{9^{9^{9^{9}}}}", "18")
        results["after"] = grade(r"\sqrt{324}", "18")

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert results == {"hang": False, "after": True}


# --- never accept a wrong answer: a generated corpus -------------------------------------------


def _renderings(value: str) -> list[str]:
    """Ways a model writes the number ``value`` (an integer string, maybe negative)."""
    n = int(value)
    with_commas = f"{n:,}"
    out = [
        value,
        f" {value} ",
        f"${value}",
        f"{value}.00",
        f"{value}%",
        f"{value} dollars",
        rf"{value}\text{{ apples}}",
        f"x = {value}",
        f"The answer is {value}.",
        rf"\boxed{{{value}}}",
        with_commas,
        f"**{value}**",
        rf"\frac{{{2 * n}}}{{2}}",
        f"{3 * n}/3",
    ]
    return out


def _wrong_answers(value: str) -> list[str]:
    n = int(value)
    wrong = [
        str(n + 1),
        str(n - 1),
        str(n * 10),
        f"{n}.5",
        f"{n} or {n + 1}",
        f"{n + 1} or {n}",
        f"{n} and {n + 1}",
        f"{n}, {n + 1}",
        f"{n} {n + 1}",
        f"about {n}",
        f"{n} thousand",
    ]
    if n != 0:
        wrong.append(str(-n))
    digits = str(abs(n))
    if len(digits) >= 2 and digits[0] != digits[1]:
        swapped = int(digits[1] + digits[0] + digits[2:])
        wrong.append(str(-swapped if n < 0 else swapped))
    return [w for w in wrong if w not in (str(n), f"+{n}")]


def test_corpus_right_renderings_accepted_and_perturbed_answers_rejected(no_symbolic):
    rng = random.Random(1234)
    truths = [str(rng.randint(0, 99)) for _ in range(60)] + [str(rng.randint(100, 999_999)) for _ in range(100)]
    truths += [str(-rng.randint(1, 5000)) for _ in range(20)] + ["0", "1", "10", "1000", "2125"]
    checked = 0
    for truth in truths:
        for right in _renderings(truth):
            assert grade(right, truth) is True, (right, truth)
            assert r1_zero_reward_fn(r1(right), truth) == CORRECT, (right, truth)
        for wrong in _wrong_answers(truth):
            for rendered in [wrong, f"${wrong}", f"{wrong} dollars", f"x = {wrong}", f"The answer is {wrong}."]:
                assert grade(rendered, truth) is False, (rendered, truth)
                assert r1_zero_reward_fn(r1(rendered), truth)["reward"] == 0.0, (rendered, truth)
                checked += 1
    assert checked > 8000 and no_symbolic() == 0


def test_reward_functions_are_importable_from_the_package_top_level():
    import rlvr

    assert rlvr.r1_zero_reward_fn is r1_zero_reward_fn
    assert rlvr.question_only_reward_fn is question_only_reward_fn
