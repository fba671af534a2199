"""Environments: what answers the model between its turns, in one table (``ENVIRONMENTS``).

An environment is an object with

- ``stop``: extra stop strings for the model's turns (a tool-call format's closing tag);
- ``reset(row, messages) -> messages``: the opening conversation of a data row (``row`` an
  ``rlvr.task.data.Example``; ``messages`` what the run's prompt makes of it);
- ``step(messages) -> EnvStep``: given the conversation so far, ending with the model's newest turn,
  either the messages to append before the model's next turn (tool results, a user's reply) or
  ``done``, and reward fields (keyword arguments the reward function receives with the response).

``rlvr.environments.rollout.run_episodes`` drives it: a group of samples per row from the engine,
then every unfinished conversation continued by the engine after the environment's messages, up to
``env.max_turns`` model turns and ``env.max_tokens`` tokens after the prompt. The trainer trains on
the whole conversation with the loss on the model's own tokens only.

Built in: ``single_turn`` (one model turn, today's behaviour: the trainer keeps its one-turn path for
it, token for token) and ``tool`` (``rlvr.environments.tool``: the model calls Python functions).
``register_environment`` adds one (docs/environments.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlvr.environments.base import Environment, EnvironmentError_, SingleTurn
from rlvr.environments.base import EnvStep as EnvStep
from rlvr.environments.formats import TOOL_FORMATS
from rlvr.environments.rollout import ChatRenderer, Episodes, TextRenderer
from rlvr.environments.tool import ToolEnvironment
from rlvr.environments.tools import TOOLS, get_tools

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlvr.config import EnvConfig, TrainConfig
    from rlvr.task.prompts import Prompt


@dataclass(frozen=True)
class EnvironmentEntry:
    build: Callable[[EnvConfig], Environment]
    """``build(env_config)``: the environment of a run."""
    multi_turn: bool = True
    """False only for ``single_turn``: the trainer then samples and tokenises as it always did."""


def _tool_env(config: EnvConfig) -> Environment:

    return ToolEnvironment(get_tools(config.tools), config.tool_format)


ENVIRONMENTS: dict[str, EnvironmentEntry] = {
    "single_turn": EnvironmentEntry(lambda config: SingleTurn(), multi_turn=False),
    "tool": EnvironmentEntry(_tool_env),
}


def register_environment(name: str, build: Callable[[EnvConfig], Any]) -> None:
    """Add environment ``name`` to the table; ``build(env_config)`` makes it for a run."""
    ENVIRONMENTS[name] = EnvironmentEntry(build)


def get_environment_entry(name: str) -> EnvironmentEntry:
    try:
        return ENVIRONMENTS[name]
    except KeyError:
        raise EnvironmentError_(f"unknown env.name {name!r}: choose one of {', '.join(sorted(ENVIRONMENTS))}") from None


def build_environment(config: EnvConfig) -> Environment:
    return get_environment_entry(config.name).build(config)


def episodes_for(config: TrainConfig, tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> Episodes | None:
    """The run's multi-turn sampling (None for ``single_turn``: the trainer's one-turn path)."""

    if not get_environment_entry(config.env.name).multi_turn:
        return None
    env = build_environment(config.env)
    chat = prompt.kind == "chat"
    bind = getattr(env, "bind", None)
    if bind is not None:  # a tool format of auto picks from the chat template
        bind(getattr(tokenizer, "chat_template", None) if chat else None)
    renderer: ChatRenderer | TextRenderer
    if chat:
        renderer = ChatRenderer(tokenizer, getattr(env, "schemas", None))
    else:
        renderer = TextRenderer(getattr(env, "format", None))
    return Episodes(env, tokenizer, renderer, config.env.max_turns, config.env.max_tokens)


def env_problems(config: TrainConfig) -> list[str]:
    """One line per ``env`` setting that cannot run (before any model loads)."""

    e = config.env
    if e.name not in ENVIRONMENTS:
        return [f"unknown env.name {e.name!r}: choose one of {', '.join(sorted(ENVIRONMENTS))}"]
    if not ENVIRONMENTS[e.name].multi_turn:
        return []
    problems = []
    if config.engine.name == "hf-worker" or config.engine.max_staleness:
        problems.append(
            f"env.name {e.name} continues conversations between turns, which the one-step-async worker "
            "engine does not do: use engine.name hf, hf-fast or vllm with engine.max_staleness 0"
        )
    if e.name == "tool":
        unknown = [t for t in e.tools if t not in TOOLS]
        if unknown:
            problems.append(f"unknown tool {unknown[0]!r} in env.tools: choose from {', '.join(sorted(TOOLS))}")
        if not e.tools:
            problems.append("env.name tool needs at least one tool in env.tools (e.g. calculator)")
        if e.tool_format != "auto" and e.tool_format not in TOOL_FORMATS:
            problems.append(
                f"unknown env.tool_format {e.tool_format!r}: choose auto or one of {', '.join(sorted(TOOL_FORMATS))}"
            )
    return problems
