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
