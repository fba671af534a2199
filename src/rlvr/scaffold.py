"""The run scaffold: what every command that writes a run directory does the same way.

**The lock comes first.** ``claimed_output_dir`` takes the directory's lock (``rundir.RunDirLock``)
before anything in it is read, deleted or written, and holds it until the command ends: a second
command on a directory in use is refused with the holder's pid and touches nothing, so a live run
never loses its metrics or checkpoints to an ``--overwrite`` or a ``--resume`` started beside it.
Only then is the directory checked for earlier results (``rundir.prepare_output_dir``) and, when
the user asked to replace them, are they removed.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

from rlvr.rundir import RunDirLock, prepare_output_dir


@contextlib.contextmanager
def claimed_output_dir(
    path: str | Path,
    produces: Iterable[str],
    overwrite: bool = False,
    *,
    replaces: Iterable[str] = (),
    flag: str = "--out",
    command: str | None = None,
) -> Iterator[Path]:
    """Lock ``path``, then check it for earlier results and yield it, locked, for the command's work.

    ``produces`` names the outputs that mark an earlier result (refused unless ``overwrite``);
    ``replaces`` names the files and folders of an earlier run that are deleted, under the lock,
    when ``overwrite`` is set (outputs that a new run would otherwise append to or mix with)."""
    with RunDirLock(path, command=command) as lock:
        out = prepare_output_dir(lock.run_dir, tuple(produces), overwrite=overwrite, flag=flag)
        if overwrite:
            remove_outputs(out, replaces)
        yield out


def remove_outputs(run_dir: Path, names: Iterable[str]) -> None:
    """Delete the files and folders ``names`` of ``run_dir`` (call it only under the directory's lock)."""
    for name in names:
        target = run_dir / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            target.unlink(missing_ok=True)
