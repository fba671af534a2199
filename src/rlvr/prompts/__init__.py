"""The protocol prompt templates, shipped verbatim, and how to render them.

Each template is a Python ``str.format`` string with one field, ``{question}``. ``r1_zero`` and the
three-shot prompt end inside ``<think>``: generation stops at ``</answer>``, which is kept in the
output so that the format rule can see it. ``question_only`` has no stop string and is graded on the
last ``\\boxed{...}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib import resources


@dataclass(frozen=True)
class PromptSpec:
    name: str
    filename: str
    stop: tuple[str, ...]
    reward_fn_name: str
    """Name of the reward function in ``rlvr.rewards`` that grades responses to this prompt."""


PROMPTS: dict[str, PromptSpec] = {
    "r1_zero": PromptSpec("r1_zero", "r1_zero.prompt", ("</answer>",), "r1_zero_reward_fn"),
    "question_only": PromptSpec("question_only", "question_only.prompt", (), "question_only_reward_fn"),
    "r1_zero_three_shot": PromptSpec(
        "r1_zero_three_shot", "r1_zero_three_shot_gsm8k.prompt", ("</answer>",), "r1_zero_reward_fn"
    ),
}


def get_prompt_spec(name: str) -> PromptSpec:
    try:
        return PROMPTS[name]
    except KeyError:
        raise ValueError(f"unknown prompt {name!r}: choose one of {sorted(PROMPTS)}") from None


@cache
def load_template(name: str) -> str:
    """The template text of prompt ``name``, byte for byte as shipped."""
    spec = get_prompt_spec(name)
    return resources.files(__package__).joinpath(spec.filename).read_text(encoding="utf-8")


def render(name: str, question: str) -> str:
    """Render prompt ``name`` for one question with ``str.format(question=...)``."""
    return load_template(name).format(question=question)


def stop_strings(name: str) -> list[str]:
    """Stop strings for prompt ``name``; generation keeps them in the output."""
    return list(get_prompt_spec(name).stop)


def reward_fn_for(name: str):
    """The reward function that grades responses to prompt ``name``."""
    from rlvr import rewards

    return getattr(rewards, get_prompt_spec(name).reward_fn_name)
