"""The error type that every ``rlvr`` command reports as one line, without a traceback.

``UserError`` is a problem the user can fix (a bad config value, a missing file, a run directory in
use): its message names the problem and the fix. ``rlvr <command>`` prints it as
``rlvr <command>: <message>`` and exits with ``exit_code``; any other exception is a bug and keeps
its traceback.
"""

from __future__ import annotations

import errno
import os


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


class DiskFullError(TrainingError):
    """A write failed for lack of disk space (or a file-size limit)."""


_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# How libraries that write without an OSError say it: safetensors quotes the OS error, torch.save only
# says that the write failed.
_FULL_TEXTS = {
    **{f"os error {n}": os.strerror(n) for n in _FULL_ERRNOS},
    **{os.strerror(n): os.strerror(n) for n in _FULL_ERRNOS},
    "file write failed": "file write failed",
}


def disk_full(e: BaseException) -> DiskFullError | None:
    """A ``DiskFullError`` when ``e`` (or what caused it) is a write that failed for lack of space,
    however the library that wrote reported it; else None."""
    seen: BaseException | None = e
    while seen is not None:
        reason: str | None
        if isinstance(seen, OSError) and seen.errno in _FULL_ERRNOS:
            reason = seen.strerror or os.strerror(seen.errno)
        else:
            reason = next((why for text, why in _FULL_TEXTS.items() if text in str(seen)), None)
        if reason:
            return DiskFullError(
                f"out of disk space while writing ({reason}); free space on the run directory's disk, or give another "
                "directory"
            )
        seen = seen.__cause__ or seen.__context__
    return None
