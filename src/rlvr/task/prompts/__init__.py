"""Prompts: the protocol templates (shipped verbatim), a user's template file, or the model's chat template.

Each protocol template is a Python ``str.format`` string with one field, ``{question}``. ``r1_zero``
and the three-shot prompt end inside ``<think>``: generation stops at ``</answer>``, which is kept in
the output so that the format rule can see it. ``question_only`` has no stop string and is graded on
the last ``\\boxed{...}``.

``resolve_prompt`` turns the ``prompt`` setting into a ``Prompt``:

- a built-in name (``r1_zero``, ``question_only``, ``r1_zero_three_shot``);
- a path to a template file of the user's, rendered like the built-ins (``{question}`` is its one
  field; literal braces are written ``{{`` and ``}}``);
- ``chat``: the model tokenizer's chat template over an optional system message and a user message
  (the question, or an optional user-message template with ``{question}``), ending with the
  generation prompt of the assistant's turn. A chat row (a data row whose question column holds
  ``{role, content}`` messages) is rendered the same way from its own messages
  (``Prompt.render_example``).

Every prompt carries its stop strings; ``PromptOptions.stop`` replaces them.
"""

from __future__ import annotations

import string
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from rlvr.errors import UserError
from rlvr.task import grading
from rlvr.task.chat import render as render_chat
from rlvr.task.rewards import BUILTIN_REWARDS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlvr.task.data import Example

CHAT = "chat"


class PromptError(UserError, ValueError):
    """A prompt setting that cannot be used."""


@dataclass(frozen=True)
class PromptSpec:
    name: str
    filename: str
    stop: tuple[str, ...]
    reward_fn_name: str
    """Name of the reward function in ``rlvr.task.grading`` that grades responses to this prompt."""


PROMPTS: dict[str, PromptSpec] = {
    "r1_zero": PromptSpec("r1_zero", "r1_zero.prompt", ("</answer>",), "r1_zero_reward_fn"),
    "question_only": PromptSpec("question_only", "question_only.prompt", (), "question_only_reward_fn"),
    "r1_zero_three_shot": PromptSpec(
        "r1_zero_three_shot", "r1_zero_three_shot_gsm8k.prompt", ("</answer>",), "r1_zero_reward_fn"
    ),
}

# The built-in reward (a name in ``rlvr.task.rewards.BUILTIN_REWARDS``) of each built-in prompt;
# template files and chat prompts are graded on their last \boxed{} unless reward.fn says otherwise.
DEFAULT_REWARD = {"r1_zero": "r1_zero", "question_only": "question_only", "r1_zero_three_shot": "r1_zero"}
OTHER_PROMPTS_REWARD = "boxed"


def get_prompt_spec(name: str) -> PromptSpec:
    try:
        return PROMPTS[name]
    except KeyError:
        raise PromptError(f"unknown prompt {name!r}: choose one of {sorted(PROMPTS)}") from None


@cache
def load_template(name: str) -> str:
    """The template text of prompt ``name``, byte for byte as shipped."""
    spec = get_prompt_spec(name)
    return resources.files(__package__).joinpath(spec.filename).read_text(encoding="utf-8")


def render(name: str, question: str) -> str:
    """Render prompt ``name`` (a built-in or a template file) for one question."""
    if name in PROMPTS:
        return load_template(name).format(question=question)
    return resolve_prompt(name).render(question)


def stop_strings(name: str) -> list[str]:
    """Stop strings for prompt ``name``; generation keeps them in the output."""
    if name in PROMPTS:
        return list(get_prompt_spec(name).stop)
    return list(resolve_prompt(name).stop)


def reward_fn_for(name: str) -> Callable[..., dict]:
    """The reward function that grades responses to prompt ``name``."""

    if name in PROMPTS:
        return getattr(grading, get_prompt_spec(name).reward_fn_name)

    return BUILTIN_REWARDS[resolve_prompt(name).default_reward]


# -- resolved prompts -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    """How a question becomes the model's input, and where generation stops."""

    name: str
    """What logs and results call it: the built-in's name, the template file's stem, or chat."""
    kind: str
    """builtin, file or chat."""
    stop: tuple[str, ...]
    default_reward: str
    template: str | None = None
    """The ``str.format`` template of a built-in or a file."""
    system: str | None = None
    user_template: str | None = None
    tokenizer: Any = None
    """The tokenizer whose chat template a chat prompt renders with (``bind``)."""

    def bind(self, tokenizer: PreTrainedTokenizerBase | None) -> Prompt:
        """This prompt rendering with ``tokenizer`` (chat prompts need it; others ignore it)."""
        if self.kind != CHAT:
            return self
        if tokenizer is None:
            raise PromptError("prompt chat renders with the model's tokenizer; bind it to one, not None")
        check_chat_template(tokenizer)
        end = end_of_turn(tokenizer)
        if end and tokenizer.eos_token and end != tokenizer.eos_token:
            warnings.warn(
                f"prompt chat: the chat template ends a turn with {end!r} but the tokenizer's EOS token is "
                f"{tokenizer.eos_token!r}, where generation stops; responses may run on past the turn. Use "
                "the instruct model's tokenizer (its EOS is the end of a turn)",
                stacklevel=2,
            )
        return replace(self, tokenizer=tokenizer)

    def render(self, question: str) -> str:
        if self.kind != CHAT:
            if self.template is None:
                raise PromptError(f"prompt {self.name} ({self.kind}) has no template to render with")
            return self.template.format(question=question)
        if self.tokenizer is None:
            raise PromptError("prompt chat renders with the model's tokenizer; bind it first (Prompt.bind)")
        return self.tokenizer.apply_chat_template(self.messages(question), tokenize=False, add_generation_prompt=True)

    def render_example(self, example: Example) -> str:
        """The model's input for a data row: a chat row's messages through the chat template (with the
        generation prompt), else ``render(question)``."""
        if example.messages is None:
            return self.render(example.question)
        if self.kind != CHAT:
            raise PromptError(chat_rows_need_chat(self.name))
        if self.tokenizer is None:
            raise PromptError("chat rows render with the model's tokenizer; bind it first (Prompt.bind)")
        return render_chat(self.tokenizer, self.example_messages(example), add_generation_prompt=True)

    def example_messages(self, example: Example) -> list[dict[str, str]]:
        """The chat messages of a data row: a chat row's own (after the prompt's system message when the
        row has none), else ``messages(question)``."""
        if example.messages is None:
            return self.messages(example.question)
        messages = [dict(m) for m in example.messages]
        if self.system is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system})
        return messages

    def messages(self, question: str) -> list[dict[str, str]]:
        """The chat messages of ``question``: a chat prompt's system and user turns; for a text
        template, one user turn holding the rendered text."""
        if self.kind != CHAT:
            return [{"role": "user", "content": self.render(question)}]
        user = self.user_template.format(question=question) if self.user_template is not None else question
        return ([{"role": "system", "content": self.system}] if self.system is not None else []) + [
            {"role": "user", "content": user}
        ]


def _check_template(text: str, where: str) -> str:
    """``text`` when it is a ``str.format`` template whose one field is ``{question}``."""
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(text) if f is not None}
    except ValueError as e:
        raise PromptError(f"{where}: not a valid template ({e}); write literal braces as {{{{ and }}}}") from None
    if fields != {"question"}:
        other = sorted(fields - {"question"})
        problem = (
            f"has the placeholder(s) {', '.join('{' + f + '}' for f in other)}"
            if other
            else "has no {question} placeholder"
        )
        raise PromptError(
            f"{where} {problem}; its one placeholder is {{question}} (write literal braces as {{{{ and }}}})"
        )
    return text


def _template_text(value: str, key: str) -> tuple[str, str]:
    """The template of a setting that is a file path or the text itself, and where it came from."""
    path = Path(value)
    if "{" not in value and len(value) < 4096 and path.is_file():
        return path.read_text(encoding="utf-8"), f"{key} file {value}"
    return value, key


def resolve_prompt(
    prompt: str, system: str | None = None, user_template: str | None = None, stop: tuple[str, ...] | None = None
) -> Prompt:
    """The ``Prompt`` that the settings name; ``PromptError`` (one line, with the fix) when they do not fit."""
    if prompt != CHAT:
        for value, key in ((system, "prompt_options.system"), (user_template, "prompt_options.user_template")):
            if value is not None:
                raise PromptError(
                    f"{key} applies to prompt chat (the model's chat template), not to prompt {prompt!r}; "
                    "unset it or write it into the template"
                )
    if prompt in PROMPTS:
        spec = PROMPTS[prompt]
        return Prompt(
            prompt,
            "builtin",
            tuple(spec.stop if stop is None else stop),
            DEFAULT_REWARD[prompt],
            template=load_template(prompt),
        )
    if prompt == CHAT:
        template = None
        if user_template is not None:
            text, where = _template_text(user_template, "prompt_options.user_template")
            template = _check_template(text, where)
        return Prompt(CHAT, CHAT, tuple(stop or ()), OTHER_PROMPTS_REWARD, system=system, user_template=template)
    path = Path(prompt)
    if not path.is_file():
        raise PromptError(
            f"unknown prompt {prompt!r}: not a built-in ({', '.join(sorted(PROMPTS))}), not chat, "
            "and no such template file; name one of those or a file with a {question} placeholder"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PromptError(f"prompt file {prompt}: cannot be read as text ({e}); pass a UTF-8 template file") from None
    return Prompt(
        path.stem,
        "file",
        tuple(stop or ()),
        OTHER_PROMPTS_REWARD,
        template=_check_template(text, f"prompt file {prompt}"),
    )


def chat_rows_need_chat(prompt_name: str) -> str:
    """The one-line error of chat rows under a text prompt."""
    return (
        f"the data's question column holds chat messages, which render with the model's chat template, but the "
        f"prompt is {prompt_name!r}: set the prompt to chat (prompt: chat in a config, --prompt chat in rlvr eval)"
    )


def end_of_turn(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The text the chat template puts after an assistant message (its end-of-turn token), if any."""
    marker = "\u2063rlvr-end-of-turn\u2063"
    try:
        text = cast(
            str,
            tokenizer.apply_chat_template(
                [{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}], tokenize=False
            ),
        )
    except Exception:  # noqa: BLE001 (templates may refuse this conversation; then there is nothing to check)
        return None
    if marker not in text:
        return None
    return text.rsplit(marker, 1)[1].strip() or None


def check_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    """``PromptError`` unless ``tokenizer`` has a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or "the model"
        raise PromptError(
            f"prompt chat: the tokenizer of {name} has no chat template; use a model that has one, "
            "a built-in prompt or a template file"
        )
