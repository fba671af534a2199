"""What an environment is (``Environment``, the ``EnvStep`` it answers a model turn with) and the built-in
``SingleTurn``: the pieces the table (``rlvr.environments``) and the environments themselves share, in a
module that imports neither."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from rlvr.errors import UserError

if TYPE_CHECKING:
    from rlvr.task.example import Example


class EnvironmentError_(UserError, ValueError):
    """An environment setting that cannot be used (an unknown name, a bad option)."""


@dataclass
class EnvStep:
    """What the environment answers a model turn with."""

    messages: list[dict] = field(default_factory=list)
    """Messages to append before the model's next turn (ignored when ``done``)."""
    done: bool = False
    reward_fields: dict = field(default_factory=dict)
    """Keyword arguments for the reward function (merged over the turns, the newest winning)."""


@runtime_checkable
class Environment(Protocol):
    @property
    def stop(self) -> tuple[str, ...]: ...

    def reset(self, row: Example, messages: list[dict]) -> list[dict]: ...

    def step(self, messages: list[dict]) -> EnvStep: ...


class SingleTurn:
    """One model turn per row: the conversation ends at the model's first answer."""

    stop: tuple[str, ...] = ()

    def reset(self, row: Example, messages: list[dict]) -> list[dict]:
        return messages

    def step(self, messages: list[dict]) -> EnvStep:
        return EnvStep(done=True)
