"""The error type that every ``rlvr`` command reports as one line, without a traceback.

``UserError`` is a problem the user can fix (a bad config value, a missing file, a run directory in
use): its message names the problem and the fix. ``rlvr <command>`` prints it as
``rlvr <command>: <message>`` and exits with ``exit_code``; any other exception is a bug and keeps
its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem in the input or the environment, explained by its message (one line)."""

    exit_code: int = 2


class TrainingError(UserError, RuntimeError):
    """The run stopped on a fault; the message says what happened and what to do."""

    exit_code = 1


class EngineError(TrainingError):
    """The rollout engine failed (start, weight load, generation, validation)."""


class GraderError(TrainingError):
    """The reward function raised or returned a non-finite reward."""


class NonFiniteError(TrainingError):
    """Too many optimizer steps in a row had a non-finite loss or gradient norm."""
