"""The run scaffold: what every command that writes a run directory does the same way.

**The lock comes first.** ``claimed_output_dir`` takes the directory's lock (``rundir.RunDirLock``)
before anything in it is read, deleted or written, and holds it until the command ends: a second
command on a directory in use is refused with the holder's pid and touches nothing, so a live run
never loses its metrics or checkpoints to an ``--overwrite`` or a ``--resume`` started beside it.
Only then is the directory checked for earlier results (``rundir.prepare_output_dir``) and, when
the user asked to replace them, are they removed.

**Summary, signals, checkpoints.** ``TrainingRun`` gives a training loop what ``rlvr train`` has:
``summary.json`` (written atomically) that says ``running`` while it runs and then ``finished``,
``interrupted`` or ``failed`` with a message; Ctrl-C and SIGTERM finish the current step, save a
checkpoint (``rlvr.training.checkpoint``) and end the command with status 130 or 143.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from rlvr.errors import UserError, disk_full
from rlvr.training.interrupts import DeferInterrupts, Terminated
from rlvr.training.rundir import RunDirLock, atomic_write_json, prepare_output_dir

SUMMARY_FILE = "summary.json"


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


class TrainingRun:
    """``summary.json`` and the graceful stop of a training loop that checkpoints (``rlvr dpo``,
    ``rlvr sft instruct``), as ``rlvr train`` has them.

    ``guarded()`` surrounds the loop: the summary says ``running`` from its start, ``interrupted``
    after Ctrl-C or SIGTERM (which end the current step, save a checkpoint and re-raise, so that the
    command exits with 130 or 143) and ``failed`` with the error's message after any other error;
    the caller writes ``finished``. ``step_block(step)`` surrounds one step: a first signal during
    it is held until the step is whole, a second one stops at once (the half step is not saved).
    ``save(step)`` writes the checkpoint of ``step``; ``fields`` are added to every summary.
    """

    def __init__(
        self,
        run_dir: Path,
        n_steps: int,
        resume_command: str,
        save: Callable[[int], None],
        start: int = 0,
        resumed: bool = False,
    ) -> None:
        self.run_dir, self.n_steps, self.resume_command, self.save = run_dir, n_steps, resume_command, save
        self.step = start
        """The last whole step."""
        self.saved_step: int | None = start if resumed else None
        self.in_step = False
        self.fields: dict[str, Any] = {}
        self._t0 = time.perf_counter()

    def summary(self, status: str, message: str = "") -> None:
        atomic_write_json(
            self.run_dir / SUMMARY_FILE,
            {
                "status": status,
                "step": self.step,
                "n_steps": self.n_steps,
                "last_checkpoint": self.saved_step,
                "message": message,
                "wall_time_s": time.perf_counter() - self._t0,
                **self.fields,
            },
        )

    def checkpoint(self) -> None:
        """Save the last whole step, once; nothing when no step ran since the last save (or the start)."""
        if self.step > (self.saved_step if self.saved_step is not None else 0):
            self.save(self.step)
            self.saved_step = self.step

    @contextlib.contextmanager
    def step_block(self, step: int) -> Iterator[None]:
        with DeferInterrupts() as deferred:
            self.in_step = True
            yield
            self.step, self.in_step = step, False
        deferred.raise_if_requested()

    @contextlib.contextmanager
    def guarded(self) -> Iterator[None]:
        self.summary("running")
        try:
            yield
        except KeyboardInterrupt as e:
            self._interrupted(e)
            raise
        except Exception as e:
            full = disk_full(e)
            message = str(full or e) if isinstance(full or e, UserError) else f"{type(e).__name__}: {e}"
            try:
                self.summary("failed", message)
            except OSError:  # no room even for the summary: none is truer than one saying "running"
                (self.run_dir / SUMMARY_FILE).unlink(missing_ok=True)
            if full is not None:
                raise full from None
            raise

    def _interrupted(self, e: KeyboardInterrupt) -> None:
        how = "stopped by SIGTERM" if isinstance(e, Terminated) else "interrupted"
        if not self.in_step:
            self.checkpoint()
        if self.saved_step is None:
            msg = f"{how} before the first checkpoint; `{self.resume_command}` starts the run again from step 0"
        elif not self.in_step and self.saved_step == self.step:
            msg = f"{how}; saved a checkpoint at step {self.step}: resume with `{self.resume_command}`"
        else:
            msg = (
                f"{how} in the middle of step {self.step + 1}, which was not saved; the checkpoint of step "
                f"{self.saved_step} is the last: resume with `{self.resume_command}`"
            )
        self.summary("interrupted", msg)
        print(f"rlvr: {msg}", file=sys.stderr)
