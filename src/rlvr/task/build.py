"""The task of a run, from its config: the prompt, the data (training and validation sets) and the reward.

``rlvr train`` and ``rlvr eval`` build the task through these functions, so that in-training
validation and a separate evaluation read the same settings the same way:

- ``task_config_problems``: what is wrong with the prompt, data and reward settings, found without
  loading anything (part of ``rlvr.checks.validate_config``);
- ``load_task_data``: the training examples and the named validation sets;
- ``prepare_reward``: the ``Reward``, its user functions loaded and checked against the data's fields;
- ``check_chat_tokenizer``: a chat prompt's model has a chat template (from a local model's
  tokenizer files, before the weights load).

A validation source of ``data.val_sources`` is ``NAME=SOURCE`` followed by options ``key=value``
separated by spaces (``split``, ``size``, ``config``, ``question_field``, ``answer_field``,
``answer_format``, ``reward``); an option left out is taken from the ``data`` section (``val_split``,
``val_size``, ...). ``reward=NAME`` grades that set with the built-in reward NAME instead of the run's
(``reward.fn``, else the prompt's own), in training validation and in ``rlvr eval --config``.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlvr.errors import UserError
from rlvr.task.data import ANSWER_FORMATS, load_examples
from rlvr.task.prompts import CHAT, PromptError, chat_rows_need_chat, check_chat_template, resolve_prompt
from rlvr.task.rewards import BUILTIN_REWARDS, reward_settings_problem, spec_problem
from rlvr.task.rewards import build_reward as build

if TYPE_CHECKING:
    from rlvr.config import TrainConfig
    from rlvr.task.data import Example
    from rlvr.task.prompts import Prompt
    from rlvr.task.rewards import Reward

VAL_SOURCE_OPTIONS = ("split", "size", "config", "question_field", "answer_field", "answer_format", "reward")


class TaskConfigError(UserError, ValueError):
    """Prompt, data or reward settings that cannot be used."""


@dataclass(frozen=True)
class DataSource:
    """One data set: where it is and how its rows become examples."""

    name: str
    source: str
    split: str
    size: int | None
    config: str | None
    question_field: str
    answer_field: str
    answer_format: str
    reward: str | None = None
    """The built-in reward that grades this set (None: the run's)."""

    def load(self, seed: int = 0) -> list[Example]:

        return load_examples(
            self.source,
            self.split,
            limit=self.size,
            seed=seed,
            question_field=self.question_field,
            answer_field=self.answer_field,
            answer_format=self.answer_format,
            config=self.config,
        )


def train_source(config: TrainConfig) -> DataSource:
    d = config.data
    return DataSource(
        "train",
        d.train_source,
        d.train_split,
        d.train_size,
        d.config,
        d.question_field,
        d.answer_field,
        d.answer_format,
    )


def val_sources(config: TrainConfig) -> list[DataSource]:
    """The validation sets: each of ``data.val_sources``, else the one of ``data.val_source`` (named ``""``)."""
    d = config.data
    base: dict[str, Any] = dict(
        split=d.val_split,
        size=d.val_size,
        config=d.config,
        question_field=d.question_field,
        answer_field=d.answer_field,
        answer_format=d.answer_format,
    )
    if not d.val_sources:
        return [DataSource("", d.val_source or d.train_source, **base)]
    return [parse_val_source(spec, base) for spec in d.val_sources]


def parse_val_source(spec: str, base: dict) -> DataSource:
    """``NAME=SOURCE [key=value ...]`` as a ``DataSource`` (options not given come from ``base``)."""
    fix = "write data.val_sources entries as 'NAME=SOURCE [split=test] [size=256] [answer_format=boxed] ...'"
    try:
        words = shlex.split(spec)
    except ValueError as e:
        raise TaskConfigError(f"data.val_sources entry {spec!r}: {e}; {fix}") from None
    if not words or "=" not in words[0]:
        raise TaskConfigError(f"data.val_sources entry {spec!r} has no NAME=SOURCE; {fix}")
    name, _, source = words[0].partition("=")
    if not name or not source or not all(c.isalnum() or c in "_-." for c in name):
        raise TaskConfigError(
            f"data.val_sources entry {spec!r}: the name must be letters, digits, _ - or . and the "
            f"source must not be empty; {fix}"
        )
    options = dict(base)
    for word in words[1:]:
        key, sep, value = word.partition("=")
        if not sep or key not in VAL_SOURCE_OPTIONS:
            raise TaskConfigError(
                f"data.val_sources entry {spec!r}: unknown option {word!r}; the options are "
                f"{', '.join(VAL_SOURCE_OPTIONS)}"
            )
        if key == "reward":
            if value not in BUILTIN_REWARDS:
                raise TaskConfigError(
                    f"data.val_sources entry {spec!r}: unknown reward {value!r}; choose one of "
                    f"{', '.join(BUILTIN_REWARDS)}"
                )
        if key == "size":
            if not value.isdigit():
                raise TaskConfigError(f"data.val_sources entry {spec!r}: size must be a whole number, got {value!r}")
            options[key] = int(value)
        else:
            options[key] = value
    return DataSource(name, source, **options)


def task_config_problems(config: TrainConfig) -> list[str]:
    """One line per problem of the prompt, data and reward settings of a ``TrainConfig`` (no loading)."""

    problems: list[str] = []
    try:
        prompt = build_prompt(config)
    except PromptError as e:
        problems.append(str(e))
        prompt = None
    if prompt is not None and prompt.kind == CHAT and config.model.fresh is not None:
        problems.append(
            "prompt chat needs the model tokenizer's chat template, and model.fresh trains a tokenizer "
            "without one; use a built-in prompt or a template file with model.fresh"
        )
    d = config.data
    if d.answer_format not in ANSWER_FORMATS:
        problems.append(f"unknown data.answer_format {d.answer_format!r}: choose one of {', '.join(ANSWER_FORMATS)}")
    for key in ("question_field", "answer_field"):
        if not getattr(d, key):
            problems.append(f"data.{key} is empty; name the column")
    if d.question_field == d.answer_field:
        problems.append(f"data.question_field and data.answer_field are both {d.question_field!r}; name two columns")
    try:
        sets = val_sources(config)
    except TaskConfigError as e:
        problems.append(str(e))
    else:
        names = [s.name for s in sets]
        if len(set(names)) != len(names):
            problems.append(f"data.val_sources names a set twice ({', '.join(names)}); give each its own name")
        if d.val_sources and d.val_source is not None:
            problems.append("set data.val_source (one validation set) or data.val_sources (several, named), not both")
        for s in sets:
            if s.name and s.answer_format not in ANSWER_FORMATS:
                problems.append(
                    f"data.val_sources {s.name}: unknown answer_format {s.answer_format!r}: choose one of "
                    f"{', '.join(ANSWER_FORMATS)}"
                )
    r = config.reward
    settings_problem = reward_settings_problem(r.fn, r.fns, r.url, r.workers, r.worker_kind)
    if settings_problem:
        problems.append(settings_problem)
    if r.weights and len(r.weights) != len(r.fns):
        problems.append(
            f"reward.weights has {len(r.weights)} numbers for {len(r.fns)} reward.fns; give one per function"
        )
    for spec, key in [(r.fn, "reward.fn")] + [(f, "reward.fns") for f in r.fns]:
        if spec is not None:
            problem = spec_problem(spec, key)
            if problem:
                problems.append(problem)
    if not r.timeout_s > 0:
        problems.append(f"reward.timeout_s must be > 0, got {r.timeout_s}")
    return problems


def build_prompt(config: TrainConfig) -> Prompt:
    """The ``Prompt`` of a ``TrainConfig`` (not yet bound to a tokenizer)."""

    o = config.prompt_options
    return resolve_prompt(config.prompt, o.system, o.user_template, o.stop)


def build_reward(config: TrainConfig, prompt: Prompt | None = None) -> Reward:
    """The ``Reward`` of a ``TrainConfig`` (user functions not started)."""

    prompt = prompt or build_prompt(config)
    r = config.reward
    return build(
        r.fn, r.fns, r.weights, r.timeout_s, prompt.default_reward, r.url, r.workers, r.worker_kind, r.code_isolation
    )


def load_task_data(config: TrainConfig) -> tuple[list[Example], list[tuple[str, list[Example]]]]:
    """``(train_examples, [(name, val_examples), ...])``; ``val_size`` 0 gives no validation sets."""
    train = train_source(config).load(seed=config.seed)
    if not config.data.val_size and not config.data.val_sources:
        return train, []
    sets = []
    for s in val_sources(config):
        if not s.size:
            continue
        examples = s.load(seed=config.seed)
        if len(examples) < s.size and s.name:
            raise TaskConfigError(
                f"data.val_sources {s.name}: size={s.size} but {s.source} ({s.split}) has only "
                f"{len(examples)} examples; lower size or choose a larger split"
            )
        sets.append((s.name, examples[: s.size]))
    return train, sets


def set_rewards(
    config: TrainConfig, sources: list[DataSource], data_sets: list[tuple[str, list[Example]]]
) -> dict[str, Reward]:
    """The started ``Reward`` of each validation set whose source names its own (``reward=NAME``), by
    set name; the other sets are graded by the run's reward."""

    examples = dict(data_sets)
    r = config.reward
    rewards = {}
    for s in sources:
        if s.reward is None or s.name not in examples:
            continue
        reward = build(s.reward, (), (), r.timeout_s, s.reward, None, r.workers, r.worker_kind, r.code_isolation)
        reward.start(sorted({k for ex in examples[s.name][:1] for k in ex.fields}))
        rewards[s.name] = reward
    return rewards


def prepare_reward(config: TrainConfig, examples: list[Example], prompt: Prompt | None = None) -> Reward:
    """The run's ``Reward``, its user functions loaded and checked against the fields of ``examples``."""
    reward = build_reward(config, prompt)
    fields = sorted({k for ex in examples[:1] for k in ex.fields})
    clash = [f for f in fields if f in ("response", "ground_truth")]
    if clash and reward.has_user_functions:
        raise TaskConfigError(
            f"the data has a column {clash[0]!r}, the name of a reward function argument; rename the "
            "column, or name it as the question or answer column"
        )
    reward.start(fields)
    return reward


def check_chat_rows(prompt: Prompt, sets: list[tuple[str, list[Example]]]) -> None:
    """``TaskConfigError`` when chat rows (questions that are message lists) meet a prompt that cannot
    render them: a text prompt, or a chat prompt with a user-message template (the rows hold their own)."""

    if not any(ex.messages is not None for _, examples in sets for ex in examples):
        return
    if prompt.kind != CHAT:
        raise TaskConfigError(chat_rows_need_chat(prompt.name))
    if prompt.user_template is not None:
        raise TaskConfigError(
            "prompt_options.user_template wraps one-string questions, and the data's chat rows hold their own "
            "user messages; leave it out"
        )


def check_chat_tokenizer(model_source: str) -> None:
    """For a local model directory: ``PromptError`` unless its tokenizer has a chat template (a hub
    model is checked once loaded)."""

    path = Path(model_source)
    if not (path / "tokenizer_config.json").is_file():
        return
    from transformers import AutoTokenizer

    check_chat_template(AutoTokenizer.from_pretrained(str(path)))


def validation_metrics(metrics: dict, name: str, first: bool) -> dict:
    """The logged values of one validation set's ``evaluate`` metrics: ``val/reward``, ... for the first
    set, and ``val/NAME/accuracy``, ... for a named one (both for a first named one); with k samples per
    question also ``avg@k`` and ``pass@j`` beside them."""
    out = {}
    samples: dict = {}
    if "avg_at_k" in metrics:
        k = max(int(j) for j in metrics["pass_at_k"])
        samples = {f"avg@{k}": metrics["avg_at_k"], **{f"pass@{j}": v for j, v in metrics["pass_at_k"].items()}}
    if first:
        out.update(
            {
                "val/reward": metrics["accuracy"],
                "val/format_reward": metrics["format_rate"],
                "val/response_length": metrics["mean_response_length"],
                "val/truncated_frac": metrics["truncated_rate"],
            }
        )
        out.update({f"val/reward/{k}": v for k, v in metrics.get("rewards", {}).items()})
        out.update({f"val/{k}": v for k, v in samples.items()})
        out.update({f"val/{k}": v for k, v in metrics.get("episodes", {}).items()})
    if name:
        out.update(
            {
                f"val/{name}/accuracy": metrics["accuracy"],
                f"val/{name}/format_reward": metrics["format_rate"],
                f"val/{name}/response_length": metrics["mean_response_length"],
                f"val/{name}/truncated_frac": metrics["truncated_rate"],
            }
        )
        out.update({f"val/{name}/reward/{k}": v for k, v in metrics.get("rewards", {}).items()})
        out.update({f"val/{name}/{k}": v for k, v in samples.items()})
    return out
