"""The protocol prompts: shipped verbatim, rendered with str.format, stop strings and reward per prompt."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlvr.task import grading
from rlvr.task.prompts import PROMPTS, load_template, render, reward_fn_for, stop_strings

SHARED_PROMPTS = Path(__file__).resolve().parents[2].parent / "shared" / "prompts"
FILES = {
    "r1_zero": "r1_zero.prompt",
    "question_only": "question_only.prompt",
    "r1_zero_three_shot": "r1_zero_three_shot_gsm8k.prompt",
}
QUESTION = "Natalia sold clips to 48 of her friends in April. How many clips? Use {braces} and \\boxed{}."


def shared_template(name: str) -> str:
    path = SHARED_PROMPTS / FILES[name]
    if not path.is_file():
        pytest.skip(f"protocol prompts not found at ../shared/prompts relative to the repo ({FILES[name]})")
    return path.read_text(encoding="utf-8")


def test_the_three_protocol_prompts_are_registered():
    assert set(PROMPTS) == set(FILES)
    assert {name: spec.filename for name, spec in PROMPTS.items()} == FILES


@pytest.mark.parametrize("name", sorted(FILES))
def test_templates_ship_verbatim(name):
    assert load_template(name) == shared_template(name)


@pytest.mark.parametrize("name", sorted(FILES))
def test_render_equals_str_format_of_the_shared_file(name):
    rendered = render(name, QUESTION)
    assert rendered == shared_template(name).format(question=QUESTION)
    # the question goes in once, untouched (its braces are not format fields)
    assert rendered.count(QUESTION) == 1


def test_r1_zero_rendering_by_hand():
    rendered = render("r1_zero", "What is 2+2?")
    assert rendered.startswith("A conversation between User and Assistant.")
    assert rendered.endswith("User: What is 2+2?\nAssistant: <think>")
    assert "{" not in rendered.replace("{question}", "")


def test_question_only_rendering_by_hand():
    # the template escapes the braces of \boxed{} for str.format; they come out single
    assert render("question_only", "What is 2+2?").startswith("What is 2+2? Please put your final answer within ")
    assert render("question_only", "Q").rstrip().endswith("boxed{}.")


def test_three_shot_prompt_ends_in_think_and_holds_the_question_last():
    rendered = render("r1_zero_three_shot", "What is 2+2?")
    assert rendered.rstrip().endswith("Assistant: <think>")
    assert rendered.rindex("What is 2+2?") > rendered.rindex("</answer>")


@pytest.mark.parametrize(
    "name, stops",
    [("r1_zero", ["</answer>"]), ("r1_zero_three_shot", ["</answer>"]), ("question_only", [])],
)
def test_stop_strings_per_prompt(name, stops):
    assert stop_strings(name) == stops


@pytest.mark.parametrize(
    "name, fn",
    [
        ("r1_zero", grading.r1_zero_reward_fn),
        ("r1_zero_three_shot", grading.r1_zero_reward_fn),
        ("question_only", grading.question_only_reward_fn),
    ],
)
def test_reward_fn_per_prompt(name, fn):
    assert reward_fn_for(name) is fn


def test_unknown_prompt_names_the_choices():
    with pytest.raises(ValueError, match="question_only"):
        render("r1_one", "Q")
