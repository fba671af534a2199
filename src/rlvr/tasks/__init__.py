"""Registry of procedurally generated tasks (loaded by name like a data source)."""

from __future__ import annotations

from typing import Callable

TASKS: dict[str, Callable] = {}


def is_task_spec(source: str) -> bool:
    return source.split(":", 1)[0] in TASKS


def load_task(source: str, split: str = "train", limit: int | None = None, seed: int = 0):
    name, _, args = source.partition(":")
    kwargs = {}
    for part in filter(None, args.split(",")):
        key, _, value = part.partition("=")
        kwargs[key.strip()] = value.strip()
    return TASKS[name](split=split, limit=limit, seed=seed, **kwargs)
