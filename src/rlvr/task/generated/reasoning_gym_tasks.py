"""``reasoning_gym:<task>``: procedurally generated reasoning tasks of the ``reasoning-gym`` package
(about a hundred generators, each with its own scorer; no download), and the ``reasoning_gym``
reward that scores with the task's own scorer.

A source ``reasoning_gym:basic_arithmetic,size=500,difficulty=2,max_terms=4`` names the generator,
then options: ``size`` (problems; default ``DEFAULT_SIZES`` per split), ``difficulty`` (a level of
the generator's curriculum, where it has one: 0 is the easiest) and any field of the generator's
config (``min_terms``, ``operators``, ...; numbers, true/false, text). The split and the run's seed
choose the generator's seed, so splits are drawn from separate streams; a generator with few
distinct problems can still repeat a question across splits.

An example's question and answer are the generator's; its fields ``rg_task``, ``rg_config`` (the
generator's config, JSON) and ``rg_index`` let the reward rebuild the entry and score the response's
answer (the ``<answer>`` text, else the last ``\\boxed{}``, else the whole response) with the
generator's ``score_answer``, which may give partial credit.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from typing import Any

from rlvr.task.example import DataError, Example
from rlvr.task.grading import final_answer_text

SPLITS = ("train", "validation", "test")
DEFAULT_SIZES = {"train": 1000, "validation": 200, "test": 200}
INSTALL_HINT = "reasoning_gym tasks need the reasoning-gym package: pip install 'rlvr[reasoning-gym]'"


def _factory() -> Any:
    try:
        from reasoning_gym import factory
    except ImportError:
        raise DataError(INSTALL_HINT) from None
    return factory


def unavailable() -> str | None:
    """Why the ``reasoning_gym`` reward cannot run here (None: it can)."""
    try:
        _factory()
    except DataError as e:
        return str(e)
    return None


def _as_field(name: str, value: str, default: Any) -> Any:
    """An option's text as the type of the config field's default."""
    try:
        if isinstance(default, bool):
            if value.lower() not in ("true", "false"):
                raise ValueError(value)
            return value.lower() == "true"
        if isinstance(default, (int, float, str)):
            return type(default)(value)
    except ValueError:
        raise DataError(f"reasoning_gym option {name}={value!r} is not a {type(default).__name__}") from None
    raise DataError(f"reasoning_gym option {name} holds a {type(default).__name__}; it cannot be set from a source")


def load_reasoning_gym(
    split: str = "train",
    limit: int | None = None,
    seed: int = 0,
    task: str | None = None,
    size: int | str | None = None,
    difficulty: int | str | None = None,
    **options: str,
) -> list[Example]:
    """``limit`` (or ``size``, or the split's default) problems of generator ``task``."""
    factory = _factory()
    if task is None:
        raise DataError("name the generator: reasoning_gym:<task>, e.g. reasoning_gym:basic_arithmetic")
    if task not in factory.DATASETS:
        raise DataError(f"reasoning_gym has no task {task!r}; its tasks: {', '.join(sorted(factory.DATASETS))}")
    if split not in SPLITS:
        raise DataError(f"reasoning_gym: unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    n = int(limit if limit is not None else size if size is not None else DEFAULT_SIZES[split])
    split_seed = int(hashlib.sha256(f"reasoning_gym|{task}|{seed}|{split}".encode()).hexdigest()[:8], 16)
    config_cls = factory.DATASETS[task][1]
    defaults = {"seed": split_seed, "size": n}
    if difficulty is not None:
        if not factory.has_curriculum(task):
            raise DataError(f"reasoning_gym task {task} has no curriculum, so no difficulty; leave it out")
        curriculum = factory.create_curriculum(task)
        try:
            curriculum.set_global_level(int(difficulty))
            config = curriculum.generate_configuration(defaults)
        except (ValueError, IndexError, KeyError) as e:
            raise DataError(
                f"reasoning_gym task {task}: difficulty={difficulty} does not fit its curriculum ({e})"
            ) from None
    else:
        config = config_cls(**defaults)
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise DataError(
            f"reasoning_gym task {task} has no option {', '.join(unknown)}; its options are "
            f"size, difficulty, {', '.join(k for k in fields if k not in ('seed', 'size'))}"
        )
    config = dataclasses.replace(config, **{k: _as_field(k, v, fields[k]) for k, v in options.items()})
    try:
        if hasattr(config, "validate"):
            config.validate()
    except (AssertionError, ValueError) as e:
        raise DataError(f"reasoning_gym task {task}: the options do not fit ({e})") from None
    config_json = json.dumps(dataclasses.asdict(config))
    data = dataset(task, config_json)
    return [
        Example(
            question=entry["question"],
            ground_truth=str(entry["answer"]),
            meta={"rg_task": task, "rg_config": config_json, "rg_index": i},
        )
        for i, entry in enumerate(data[i] for i in range(n))
    ]


@functools.lru_cache(maxsize=64)
def dataset(task: str, config_json: str) -> Any:
    """The generator ``task`` with the config of ``config_json`` (its entries are rebuilt from it)."""
    factory = _factory()
    config_cls = factory.DATASETS[task][1]
    values = json.loads(config_json)
    # JSON has no tuples; the generators' configs hold some (operators, ...).
    tuples = {f.name for f in dataclasses.fields(config_cls) if isinstance(f.default, tuple)}
    values = {k: tuple(v) if k in tuples and isinstance(v, list) else v for k, v in values.items()}
    return factory.create_dataset(task, **values)


def reasoning_gym_reward_fn(response: str, ground_truth: str, **fields: Any) -> dict[str, float]:
    """The generator's own score of the response's answer (see the module docstring)."""
    try:
        task, config_json, index = fields["rg_task"], fields["rg_config"], int(fields["rg_index"])
    except KeyError:
        raise DataError(
            "the reasoning_gym reward scores examples of a reasoning_gym:<task> source (fields rg_task, "
            "rg_config, rg_index); use another reward for this data"
        ) from None
    data = dataset(task, config_json)
    score = float(data.score_answer(answer=final_answer_text(response).strip(), entry=data[index]))
    return {"reward": score, "answer_reward": score}
