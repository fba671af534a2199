"""The run scaffold: what every command that writes a run directory does the same way.

**The lock comes first.** ``claimed_output_dir`` takes the directory's lock (``rundir.RunDirLock``)
before anything in it is read, deleted or written, and holds it until the command ends: a second
command on a directory in use is refused with the holder's pid and touches nothing, so a live run
never loses its metrics or checkpoints to an ``--overwrite`` or a ``--resume`` started beside it.
Only then is the directory checked for earlier results (``rundir.prepare_output_dir``) and, when
the user asked to replace them, are they removed.

**Summary, signals, checkpoints.** ``TrainingRun`` gives every training loop (``rlvr train``,
``rlvr dpo``, ``rlvr sft``, ``rlvr sft instruct``) the same record: ``summary.json`` (written atomically) that says
``running`` while it runs and then ``finished``, ``interrupted`` or ``failed`` with a message; Ctrl-C
and SIGTERM finish the current step, save a checkpoint (``rlvr.training.checkpoint``) and end the
command with status 130 or 143; a fault's message says which checkpoint is intact and how to resume.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from rlvr.errors import TrainingError, UserError, disk_full
from rlvr.training.checkpoint import CKPT_DIR, verified_by_manifest
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
    """``summary.json``, the graceful stop and the failure record of a training loop that checkpoints:
    one object under ``rlvr train``, ``rlvr dpo``, ``rlvr sft`` and ``rlvr sft instruct``.

    ``guarded()`` surrounds the loop: the summary says ``running`` from its start, ``interrupted``
    after Ctrl-C or SIGTERM (which save the last whole step and re-raise, so that the command exits
    with 130 or 143) and ``failed`` with the error's message after any other error (a
    ``TrainingError``'s message gains what is on disk and how to resume); the caller writes
    ``finished``. ``step_block(step)`` surrounds one step: a first signal during it is held until
    the step is whole, a second one stops at once (the half step is not saved). ``save(step)`` writes
    the checkpoint of ``step``; ``fields`` are added to every summary.

    A trainer with more to say refines the hooks: ``summary_fields`` (what else the summary holds),
    ``half_step`` (whether a checkpoint now would hold half a step), ``step`` and ``saved_step`` (kept
    in its own loop state). Over several ranks, rank 0 writes the summary (``is_main``) and every rank
    writes its own failure, named by ``rank_label``.
    """

    def __init__(
        self,
        run_dir: Path,
        n_steps: int,
        resume_command: str,
        save: Callable[[int], None],
        start: int = 0,
        resumed: bool = False,
        *,
        is_main: bool = True,
        rank_label: str = "",
    ) -> None:
        self.run_dir, self.n_steps, self.resume_command, self.save = run_dir, n_steps, resume_command, save
        self.is_main, self.rank_label = is_main, rank_label
        self.step = start
        """The last whole step."""
        self.saved_step = start if resumed else None
        """The step of the newest checkpoint (None: none yet)."""
        self.in_step = False
        self.fields: dict[str, Any] = {}
        self._t0 = time.perf_counter()

    # -- what a trainer may refine

    def summary_fields(self) -> dict[str, Any]:
        """What the summary holds besides status, steps, message and wall time."""
        return {"last_checkpoint": self.saved_step, **self.fields}

    def half_step(self) -> bool:
        """Whether the model holds part of a step (a checkpoint now would save half a step)."""
        return self.in_step

    # -- the record

    def summary(self, status: str, message: str = "", every_rank: bool = False) -> None:
        """Write summary.json: rank 0 alone, unless ``every_rank`` (a failure, which may be one rank's own)."""
        if not (self.is_main or every_rank):
            return
        atomic_write_json(
            self.run_dir / SUMMARY_FILE,
            {
                "status": status,
                "step": self.step,
                "n_steps": self.n_steps,
                **self.summary_fields(),
                "message": message,
                "wall_time_s": time.perf_counter() - self._t0,
            },
        )

    def checkpoint(self) -> None:
        """Save the last whole step, once; nothing when no step ran since the last save (or the start)."""
        if self.step > (self.saved_step if self.saved_step is not None else 0):
            self.save(self.step)
            self.saved_step = self.step

    def resume_hint(self) -> str:
        """What is on disk after a fault, and how to go on."""
        if self.saved_step is None:
            return (
                "No checkpoint was saved yet, so nothing is lost beyond the steps run: fix the cause and run "
                f"`{self.resume_command}` to start again from step 0."
            )
        # Only checksums make "intact" true; a checkpoint resumed without them was only seen to load.
        ckpt = self.run_dir / CKPT_DIR / f"step_{self.saved_step:06d}"
        state = "is intact" if verified_by_manifest(ckpt) else "has no checksums (not known to be intact)"
        return (
            f"The checkpoint of step {self.saved_step} {state}: fix the cause and resume with `{self.resume_command}`."
        )

    @contextlib.contextmanager
    def step_block(self, step: int, agree: Callable[[int | None], int | None] | None = None) -> Iterator[None]:
        """One step; ``agree`` makes every rank act on a signal any rank received (the largest)."""
        with DeferInterrupts() as deferred:
            self.in_step = True
            yield
            self.step, self.in_step = step, False
        if agree is not None:
            deferred.requested = agree(deferred.requested)
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
            error = full or e
            if isinstance(error, TrainingError):
                text = str(error).rstrip()
                # what is on disk is known only here
                error.args = (f"{text}{'' if text.endswith('.') else '.'} {self.resume_hint()}",)
            message = str(error) if isinstance(error, UserError) else f"{type(error).__name__}: {error}"
            try:
                self.summary("failed", self.rank_label + message, every_rank=True)
            except OSError:  # no room even for the summary: none is truer than one saying "running"
                (self.run_dir / SUMMARY_FILE).unlink(missing_ok=True)
            if full is not None:
                raise full from None
            raise

    def _interrupted(self, e: KeyboardInterrupt) -> None:
        how = "stopped by SIGTERM" if isinstance(e, Terminated) else "interrupted"
        half = self.half_step()
        if not half:
            self.checkpoint()
        if self.saved_step is None:
            msg = f"{how} before the first checkpoint; `{self.resume_command}` starts the run again from step 0"
        elif not half and self.saved_step == self.step:
            msg = f"{how}; saved a checkpoint at step {self.step}: resume with `{self.resume_command}`"
        else:
            msg = (
                f"{how} in the middle of step {self.step + 1}, which was not saved; the checkpoint of step "
                f"{self.saved_step} is the last: resume with `{self.resume_command}`"
            )
        self.summary("interrupted", msg)
        if self.is_main:
            print(f"rlvr: {msg}", file=sys.stderr)
