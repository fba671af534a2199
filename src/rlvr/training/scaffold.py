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
import dataclasses
import json
import shutil
import sys
import time
import typing
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from rlvr.config import convert_value
from rlvr.errors import TrainingError, UserError, disk_full
from rlvr.training.checkpoint import CKPT_DIR, verified_by_manifest
from rlvr.training.interrupts import DeferInterrupts, Terminated
from rlvr.training.rundir import RunDirLock, atomic_write_json, prepare_output_dir

SUMMARY_FILE = "summary.json"
INVOCATION_FLAGS = ("resume", "overwrite", "fresh_optimizer")
"""Flags of one invocation of a trainer command: never saved with the run's settings nor taken from them."""

_Config = TypeVar("_Config")


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


def saved_settings(config: Any) -> dict[str, Any]:
    """A trainer command's flat dataclass config as its run directory keeps it: JSON values (paths as
    strings, tuples as lists), with the flags of one invocation (``INVOCATION_FLAGS``) at their defaults."""
    defaults = type(config)()
    kept = dataclasses.replace(config, **{k: getattr(defaults, k) for k in INVOCATION_FLAGS if hasattr(defaults, k)})
    return {k: _as_json(v) for k, v in dataclasses.asdict(kept).items()}


def settings_from_saved(cls: type[_Config], saved: dict[str, Any]) -> _Config:
    """The ``cls`` config that ``saved_settings`` wrote, each value checked and converted to its field's
    type as config files are (``rlvr.config.convert_value``: paths and tuples come back); keys that are
    not fields of ``cls`` (what else a command records beside its settings) are ignored."""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]  # a dataclass type
    return cls(**{k: convert_value(v, hints[k], k) for k, v in saved.items() if k in fields})


def resumed_settings(
    config: _Config,
    run_dir: Path,
    file: str,
    resumable: Iterable[str],
    command: str,
    accepts: Callable[[dict[str, Any]], bool] = lambda saved: True,
) -> _Config:
    """The settings saved in ``run_dir/file`` by ``command``, with those of ``resumable`` that ``config``
    sets (away from their defaults) and this invocation's ``fresh_optimizer``, pointed at ``run_dir``.

    A missing or unreadable file, or one that ``accepts`` refuses (another command's), is a ``UserError``."""
    path = run_dir / file
    fix = f"is {run_dir} an `{command}` run directory? Put its {file} back, or start a new run with --out"
    if not path.is_file():
        raise UserError(f"{path} is missing: {fix}")
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is unreadable ({type(e).__name__}: {e}): {fix}") from None
    if not isinstance(saved, dict):
        raise UserError(
            f"{path} holds a JSON {type(saved).__name__}, not the object of settings `{command}` writes: {fix}"
        )
    if not accepts(saved):
        raise UserError(f"{path} was written by another command: {fix}")
    try:
        base = settings_from_saved(type(config), saved)
    except (TypeError, ValueError) as e:  # ConfigError (a wrong value) is a ValueError
        raise UserError(f"{path} does not hold `{command}` settings ({e}): {fix}") from None
    defaults = type(config)()
    given = {
        k: getattr(config, k)
        for k in resumable
        if k not in INVOCATION_FLAGS and getattr(config, k) != getattr(defaults, k)
    }
    return dataclasses.replace(  # type: ignore[type-var]  # a dataclass instance
        base,
        **given,
        out=run_dir,
        resume=run_dir,
        overwrite=False,
        fresh_optimizer=typing.cast(Any, config).fresh_optimizer,
    )


def _as_json(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (tuple, list)):
        return [_as_json(v) for v in value]
    return value


class TrainCallback:
    """Hooks into a training loop, in the manner of transformers' ``TrainerCallback``: subclass it and
    override what you need; ``rlvr.commands.train.train(..., callbacks=[...])`` calls each one in order.

    A hook runs inside the step's signal guard: ``KeyboardInterrupt`` raised from ``on_step_begin`` stops
    the run as Ctrl-C would (the last whole step is saved); any other exception fails the run."""

    def on_step_begin(self, step: int, run_dir: Path) -> None:
        """Before step ``step`` samples its rollouts; the model holds the weights step ``step - 1`` left."""

    def on_step_end(self, step: int, run_dir: Path, metrics: dict[str, Any]) -> None:
        """After step ``step`` is logged (and checkpointed, when one was due); ``metrics`` is its record."""


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
