"""Registry of procedurally generated tasks (loaded by name like a data source).

A task is a function ``(split, limit, seed, **knobs) -> list[Example]``; a source string
``name:key=value,...`` passes its knobs as strings, and the task converts them. Task modules are
imported only when a task is loaded, so importing ``rlvr.task.generated`` does no work.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlvr.task.example import DataError

if TYPE_CHECKING:
    from rlvr.task.example import Example


class _LazyTask:
    """A registry entry that imports ``module`` and calls its ``attr`` on first use."""

    def __init__(self, module: str, attr: str) -> None:
        self.module, self.attr = module, attr

    def __call__(self, *args: Any, **kwargs: Any) -> list[Example]:
        return getattr(importlib.import_module(self.module), self.attr)(*args, **kwargs)


TASKS: dict[str, Callable] = {
    "arith": _LazyTask("rlvr.task.generated.arithmetic", "load_arithmetic"),
    "code": _LazyTask("rlvr.task.generated.code", "load_code"),
    "reasoning_gym": _LazyTask("rlvr.task.generated.reasoning_gym_tasks", "load_reasoning_gym"),
}


def is_task_spec(source: str) -> bool:
    return source.split(":", 1)[0] in TASKS


def load_task(source: str, split: str = "train", limit: int | None = None, seed: int = 0) -> list[Example]:
    name, _, args = source.partition(":")
    task = TASKS[name]
    target = getattr(importlib.import_module(task.module), task.attr) if isinstance(task, _LazyTask) else task
    known = inspect.signature(target).parameters
    kwargs = {}
    parts = [p for p in args.split(",") if p]
    if parts and "=" not in parts[0] and "task" in known:  # a generator first: reasoning_gym:basic_arithmetic
        kwargs["task"] = parts.pop(0).strip()
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep:
            raise DataError(
                f"task option {part!r} in {source!r} is not key=value; write e.g. 'arith:steps=2,max_value=20'"
            )
        kwargs[key.strip()] = value.strip()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in known.values()):
        unknown = sorted(set(kwargs) - set(known) - {"split", "limit", "seed"})
        if unknown:
            options = sorted(set(known) - {"split", "limit", "seed"})
            raise DataError(f"task {name} has no option {', '.join(unknown)}; its options are {', '.join(options)}")
    return task(split=split, limit=limit, seed=seed, **kwargs)
