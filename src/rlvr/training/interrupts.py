"""Ctrl-C and SIGTERM stop a command the same graceful way.

SIGTERM is what ``timeout``, job schedulers and a stopping sweep send. ``sigterm_as_interrupt``
turns it into ``Terminated``, a ``KeyboardInterrupt``, so the same cleanup runs for both (the
trainer saves a checkpoint and writes ``summary.json``). Commands exit with status 130 after
Ctrl-C and 143 after SIGTERM (128 + the signal number, as a shell reports a process killed by it).

``DeferInterrupts`` holds either signal back during a piece of work that should finish (one
training step): the first signal is recorded and raised after the block by ``raise_if_requested``;
a second one interrupts at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType

EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_TERMINATED = 143  # 128 + SIGTERM


class Terminated(KeyboardInterrupt):
    """A SIGTERM, handled like Ctrl-C."""


def exit_code(exc: BaseException) -> int:
    return EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPTED


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated()


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block (main thread only; elsewhere a no-op) SIGTERM raises ``Terminated``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class DeferInterrupts:
    """While active, a first Ctrl-C or SIGTERM only sets ``requested``; a second one interrupts at
    once. Outside the main thread signals cannot be caught, so this does nothing there."""

    _NAMES: dict[int, str] = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}

    def __init__(self, what: str = "finishing this step, then saving a checkpoint"):
        self.what = what
        self.requested: int | None = None
        self._previous: dict = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is not None:
            raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
        self.requested = signum
        name = self._NAMES.get(signum, f"signal {signum}")
        print(f"\nrlvr: {name}: {self.what} ({name} again to stop without saving)", file=sys.stderr)

    def __enter__(self) -> DeferInterrupts:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def raise_if_requested(self) -> None:
        if self.requested == signal.SIGTERM:
            raise Terminated()
        if self.requested is not None:
            raise KeyboardInterrupt()


def stop_with_parent(parent_pid: int) -> None:
    """Ask the kernel to send this process SIGTERM when its parent dies (Linux; elsewhere a no-op),
    and stop now if ``parent_pid`` is already gone: a sweep's runs end with the sweep, however it ends."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before the request above
        os.kill(os.getpid(), signal.SIGTERM)
