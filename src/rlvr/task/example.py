"""One task example and the error for malformed task data: what the loaders (``rlvr.task.data``) and the
generated tasks (``rlvr.task.generated``) share, in a module that imports neither."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlvr.errors import UserError


@dataclass(frozen=True)
class Example:
    question: str
    ground_truth: str
    solution: str | None = None
    """A worked solution when the source has one (GSM8K rationales), for supervised warm starts."""
    meta: dict = field(default_factory=dict, compare=False, hash=False)
    """The row's other columns: they reach the reward function as keyword arguments."""
    messages: tuple[dict[str, str], ...] | None = field(default=None, hash=False)
    """A chat row's conversation (system, few-shot turns, user), rendered with the model's chat template;
    ``question`` is then its last user message."""

    @property
    def fields(self) -> dict:
        """The keyword arguments of the reward function for this example (the row's other columns)."""
        return self.meta


class DataError(UserError, ValueError):
    """Malformed task data."""
