"""Output directories: one writer at a time, files replaced whole, nothing overwritten by surprise.

**Lock.** A run directory is written by one process at a time. ``RunDirLock`` takes an exclusive
``flock`` on ``DIR/.rlvr.lock`` and writes its holder (pid, host, command, start time) into that
file; a second writer is refused with a message naming the holder. The kernel releases the lock
when its holder exits, however it exits, so the lock of a killed process is taken over by the next
one (which says so). A holder that ends normally empties the file.

**Atomic writes.** ``atomic_write_text`` writes a temporary file beside the target, fsyncs it and
renames it over the target, so that a reader (or a run resumed after a kill) sees the old content or
the new one, never a mix.

**Output directories** of one-shot commands (``rlvr eval``, ``rlvr sft``) are checked before any
work by ``prepare_output_dir``: an earlier result is replaced only when asked (``--overwrite``).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import socket
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rlvr.errors import UserError

LOCK_FILE = ".rlvr.lock"


class RunDirBusy(UserError):
    """Another process holds the run directory's lock."""


# ---------------------------------------------------------------------------------------------
# Atomic writes
# ---------------------------------------------------------------------------------------------


def fsync_dir(path: str | Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems do not support fsync on directories
    finally:
        os.close(fd)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that readers see either the old or the new content."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)


def atomic_write_json(path: str | Path, obj: Any, **dumps_kwargs: Any) -> None:
    atomic_write_text(path, json.dumps(obj, **{"indent": 2, **dumps_kwargs}) + "\n")


def atomic_write_jsonl(path: str | Path, rows: Iterable[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


# ---------------------------------------------------------------------------------------------
# The run-directory lock
# ---------------------------------------------------------------------------------------------


def _describe(holder: dict) -> str:
    pid = holder.get("pid", "?")
    parts = [f"pid {pid}"]
    if holder.get("host") and holder["host"] != socket.gethostname():
        parts[0] += f" on {holder['host']}"
    if holder.get("command"):
        parts.append(f"`{holder['command']}`")
    if holder.get("since"):
        parts.append(f"since {holder['since']}")
    return ", ".join(parts)


def _read_holder(fd: int) -> dict:
    try:
        raw = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
    except OSError:
        return {}
    if not raw:
        return {}
    try:
        holder = json.loads(raw)
    except json.JSONDecodeError:
        return {"pid": raw[:40]}
    return holder if isinstance(holder, dict) else {}


class RunDirLock:
    """Exclusive lock of a run directory (created if missing); use as a context manager.

    ``acquire`` raises ``RunDirBusy`` naming the holder when another process (or another lock object
    of this process) holds it. ``took_over`` is the holder record left by a process that died
    holding the lock, when there was one.
    """

    def __init__(self, run_dir: str | Path, command: str | None = None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.command = command if command is not None else " ".join(["rlvr", *sys.argv[1:]])[:200]
        self.took_over: dict | None = None
        self._fd: int | None = None

    def acquire(self) -> RunDirLock:
        import fcntl

        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise UserError(f"{self.run_dir} is a file, not a directory; choose another --out")
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UserError(
                f"cannot use {self.run_dir} as a run directory: {e.strerror or e}; choose another --out"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            pid = holder.get("pid", "?")
            raise RunDirBusy(
                f"{self.run_dir} is in use by another process ({_describe(holder)}); wait for it to end or stop it "
                f"(kill {pid}), then run this again"
            ) from None
        previous = _read_holder(fd)
        if previous:
            self.took_over = previous
            print(
                f"rlvr: took over the lock of {self.run_dir} left by {_describe(previous)}, which ended without "
                "releasing it",
                file=sys.stderr,
            )
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": self.command,
            "since": _dt.datetime.now().isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        import fcntl

        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)  # an empty file: released cleanly, nothing to take over
        except OSError:
            pass
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def lock_holder(run_dir: str | Path) -> dict | None:
    """The holder record of a locked run directory (``{}`` when unknown), or None when it is free."""
    import fcntl

    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_holder(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def describe_holder(holder: dict) -> str:
    return _describe(holder)


# ---------------------------------------------------------------------------------------------
# Output directories of one-shot commands
# ---------------------------------------------------------------------------------------------


def prepare_output_dir(path: str | Path, produces: Iterable[str], overwrite: bool = False, flag: str = "--out") -> Path:
    """Check and create the output directory ``path`` before any work.

    Refuses a path that is a file, a directory that already holds one of the files the command
    ``produces`` (unless ``overwrite``), and a directory that cannot be created or written.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path} is a file; give a directory (it will hold {', '.join(produces)})")
    if path.is_dir() and not overwrite:
        present = [name for name in produces if (path / name).exists()]
        if present:
            raise UserError(
                f"{flag} {path} already holds results ({', '.join(present)}); pass --overwrite to replace "
                f"them, or choose another {flag}"
            )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create {flag} {path}: {e.strerror or e}; choose another {flag}") from None
    if not os.access(path, os.W_OK):
        raise UserError(f"{flag} {path} is not writable; choose another {flag}")
    return path
