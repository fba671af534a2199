"""Running model-written Python without trusting it: ``run_python(code, ...) -> SandboxResult``.

Each call writes ``code`` as ``main.py`` (and ``files``) into a fresh temporary directory, removed
afterwards, and runs it through ``rlvr/sandbox/launcher.py`` (see there for each step), which gives
the code:

- new mount, PID and network namespaces (a user namespace too when the trainer is not root): no
  network at all (not even 127.0.0.1), no view of the trainer's processes, every mount read-only
  but its own directory;
- an unprivileged user: as root the code runs under a user id of its own, unused on the machine
  (``UID_BASE`` + up to ``UID_COUNT``), so that the process limit of one call does not count
  another's, and the interpreter's installation is bound into view read-only; as another user it keeps that user's id outside the
  namespace, so it can *read* what that user can read, but it cannot write outside its directory
  or signal a process outside;
- resource limits: CPU seconds, address space (``memory_mb``), processes, file size, open files,
  no core dumps;
- its own session and process group, an empty environment, the standard library only
  (``python -I -S``).

The call returns within ``timeout_s`` (plus the time to kill): past it, or past ``max_output_bytes``
of output on either stream, the whole process group is killed, and with it PID 1 of the code's
namespace, which takes every process the code started with it.

Where the kernel refuses namespaces (unprivileged user namespaces switched off), the first call says
so once in the log and every call raises ``SandboxUnavailable``, unless ``require_isolation=False``:
the code then runs with only the limits, the process group, the empty environment and the temporary
directory, with the network and the file system of the trainer's user open to it, and never as root.
``isolation_problem()`` says what that check found; ``known_isolation_problem(...)`` supplies the
answer for a block instead of the check.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO, cast

from rlvr.errors import UserError

log = logging.getLogger(__name__)

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launcher.py")
MAX_OUTPUT_BYTES = 1_000_000
"""Default cap on each of stdout and stderr; past it the code is stopped (``stopped="output_limit"``)."""
MAX_PROCESSES = 64
"""Processes and threads the code's user may have at once: a fork bomb stops there."""
MAX_FILE_BYTES = 16 * 1024 * 1024
MAX_OPEN_FILES = 64
KILL_GRACE_S = 0.5
"""Seconds allowed, after the kill, for the processes to be reaped."""
UID_BASE = 2_000_000_000
"""As root, each call's code runs under a user id from here, far above any system's or person's."""
UID_COUNT = 100_000_000

# How a process that died by a signal was stopped, by signal; others read "signal NAME".
STOPPED_BY_SIGNAL = {
    signal.SIGXCPU: "cpu_time",
    signal.SIGXFSZ: "file_size",
}


class SandboxUnavailable(UserError, RuntimeError):
    """This machine cannot isolate the code as asked (see the message for the fix)."""


class SandboxError(RuntimeError):
    """The launcher could not set up the confinement for this call (the code did not run)."""


@dataclass(frozen=True)
class SandboxResult:
    """What a run gave: ``returncode`` is negative for a signal (as ``subprocess`` has it);
    ``stopped`` says why the code did not end on its own (``timeout``, ``output_limit``,
    ``cpu_time``, ``file_size``, ``memory`` or ``signal NAME``), None when it did."""

    stdout: str
    stderr: str
    returncode: int | None
    timed_out: bool
    stopped: str | None

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.stopped is None


_calls = itertools.count()
_isolation_lock = threading.Lock()
_isolation_checked: list[str | None] = []


def isolation_problem() -> str | None:
    """Why this machine cannot run the code in its own namespaces (None: it can); checked once by a
    run of the launcher that sets everything up and runs nothing, and said once in the log."""
    with _isolation_lock:
        if not _isolation_checked:
            problem = _probe()
            if problem:
                log.warning("rlvr.sandbox: code cannot be isolated on this machine: %s", problem)
            _isolation_checked.append(problem)
        return _isolation_checked[0]


@contextmanager
def known_isolation_problem(problem: str | None) -> Iterator[None]:
    """Within the block, take ``problem`` as what ``isolation_problem`` found (None: the code can be
    isolated) instead of probing: for a caller that knows the answer already (a container that forbids
    namespaces), or that tries the unisolated path on a machine that has them. What was found before,
    or that nothing was, is restored after."""
    with _isolation_lock:
        earlier = list(_isolation_checked)
        _isolation_checked[:] = [problem]
    try:
        yield
    finally:
        with _isolation_lock:
            _isolation_checked[:] = earlier


def _probe() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"namespaces are Linux's; this is {sys.platform}"
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="rlvr-sandbox-"))
    try:
        status, _, _, returncode, _ = _launch(workdir, b"", 10.0, 1000, _limits(10.0, 256), True, probe=True)
    except SandboxError as e:
        return str(e)
    finally:
        _remove(workdir)
    if status != "ok" or returncode != 0:
        return f"the launcher's check ended with status {returncode} ({status or 'no report'})"
    return None


def _limits(timeout_s: float, memory_mb: int) -> dict[str, int | list[int]]:
    cpu = math.ceil(timeout_s)
    return {
        "cpu_s": [cpu, cpu + 1],
        "address_space_bytes": memory_mb * 1024 * 1024,
        "processes": MAX_PROCESSES,
        "file_size_bytes": MAX_FILE_BYTES,
        "open_files": MAX_OPEN_FILES,
        "core_bytes": 0,
    }


def run_python(
    code: str,
    *,
    stdin: str = "",
    timeout_s: float = 10,
    memory_mb: int = 512,
    files: Mapping[str, str | bytes] | None = None,
    max_output_bytes: int = MAX_OUTPUT_BYTES,
    require_isolation: bool = True,
) -> SandboxResult:
    """Run ``code`` as ``main.py`` with ``stdin`` in a sandbox (see the module docstring); ``files``
    maps names relative to its directory to contents written there first."""
    if timeout_s <= 0 or memory_mb <= 0 or max_output_bytes <= 0:
        raise ValueError("timeout_s, memory_mb and max_output_bytes must be positive")
    isolate = True
    problem = isolation_problem()
    if problem:
        if require_isolation:
            raise SandboxUnavailable(
                f"model-written code cannot be isolated here ({problem}): allow unprivileged user namespaces "
                "(sysctl user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1) or opt out with "
                "require_isolation=False, which leaves the network and your files open to the code"
            )
        isolate = False
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="rlvr-sandbox-"))
    try:
        _write_files(workdir, {"main.py": code, **(files or {})})
        status, out, err, returncode, stopped = _launch(
            workdir, stdin.encode(), timeout_s, max_output_bytes, _limits(timeout_s, memory_mb), isolate
        )
    finally:
        _remove(workdir)
    # An exec that fails after the launcher said ok adds its error line.
    error = next((line for line in status.splitlines() if line.startswith("error:")), None)
    if error is not None:
        raise SandboxError(f"the sandbox could not be set up: {error[len('error:') :].strip()}")
    stderr = err.decode(errors="replace")
    if stopped is None and returncode is not None and returncode < 0:
        sig = signal.Signals(-returncode)
        stopped = STOPPED_BY_SIGNAL.get(sig, f"signal {sig.name}")
    elif stopped is None and returncode and stderr.rstrip().rpartition("\n")[2].startswith("MemoryError"):
        stopped = "memory"
    return SandboxResult(
        stdout=out.decode(errors="replace"),
        stderr=stderr,
        returncode=returncode,
        timed_out=stopped == "timeout",
        stopped=stopped,
    )


def _write_files(workdir: str, files: Mapping[str, str | bytes]) -> None:
    for name, content in files.items():
        path = os.path.realpath(os.path.join(workdir, name))
        if os.path.isabs(name) or not path.startswith(workdir + os.sep):
            raise ValueError(f"sandbox file {name!r} must be a relative path inside the sandbox's directory")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(content.encode() if isinstance(content, str) else content)


def _remove(workdir: str) -> None:
    """Delete the directory, after giving its owner back the folders the code took the permissions off
    (never through a link the code left there)."""
    os.chmod(workdir, 0o700)
    for dirpath, dirnames, _ in os.walk(workdir):
        for name in dirnames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                os.chmod(path, 0o700)
    shutil.rmtree(workdir)


def _launch(
    workdir: str,
    stdin: bytes,
    timeout_s: float,
    max_output_bytes: int,
    limits: dict,
    isolate: bool,
    probe: bool = False,
) -> tuple[str, bytes, bytes, int | None, str | None]:
    """Run the launcher; (its status line, stdout, stderr, return code, why it was stopped)."""
    status_read, status_write = os.pipe()
    settings = {
        "workdir": workdir,
        "isolate": isolate,
        "limits": limits,
        "python": os.path.realpath(sys.executable),
        "prefix": sys.base_prefix,
        "status_fd": status_write,
        "uid": UID_BASE + (os.getpid() * 1_000_003 + next(_calls)) % UID_COUNT,
        "parent_pid": os.getpid(),
        "probe": probe,
    }
    deadline = time.monotonic() + timeout_s
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", LAUNCHER, json.dumps(settings)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workdir,
            env={},
            start_new_session=True,
            pass_fds=(status_write,),
        )
    finally:
        os.close(status_write)
    with os.fdopen(status_read, "rb") as status_pipe:
        out, err, status, stopped = _exchange(proc, status_pipe, stdin, deadline, max_output_bytes)
        if stopped is not None:
            _kill_group(proc.pid)
        try:
            proc.wait(max(deadline - time.monotonic(), 0) + KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            stopped = "timeout"
            _kill_group(proc.pid)
            proc.wait()
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None and not pipe.closed:
            pipe.close()
    return status.decode(errors="replace").strip(), out, err, proc.returncode, stopped


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _exchange(
    proc: subprocess.Popen, status_pipe: BinaryIO, stdin: bytes, deadline: float, cap: int
) -> tuple[bytes, bytes, bytes, str | None]:
    """Feed stdin and read stdout, stderr and the status pipe until they close, the deadline passes
    or an output stream passes ``cap`` bytes; (stdout, stderr, status, why stopped)."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    buffers = {proc.stdout: bytearray(), proc.stderr: bytearray(), status_pipe: bytearray()}
    selector = selectors.DefaultSelector()
    for pipe in buffers:
        os.set_blocking(pipe.fileno(), False)
        selector.register(pipe, selectors.EVENT_READ)
    pending = memoryview(stdin)
    if pending:
        os.set_blocking(proc.stdin.fileno(), False)
        selector.register(proc.stdin, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    stopped = None
    with selector:
        while selector.get_map() and stopped is None:
            left = deadline - time.monotonic()
            if left <= 0:
                stopped = "timeout"
                break
            for key, _ in selector.select(left):
                pipe = cast(BinaryIO, key.fileobj)
                if pipe is proc.stdin:
                    try:
                        written = os.write(proc.stdin.fileno(), pending[: 1 << 16])
                    except BrokenPipeError:
                        written = len(pending)
                    pending = pending[written:]
                    if not pending:
                        selector.unregister(pipe)
                        proc.stdin.close()
                    continue
                chunk = os.read(pipe.fileno(), 1 << 16)
                if not chunk:
                    selector.unregister(pipe)
                    continue
                buffer = buffers[pipe]
                room = cap - len(buffer)
                buffer += chunk[:room]
                if len(chunk) > room:
                    stopped = "output_limit"
    return bytes(buffers[proc.stdout]), bytes(buffers[proc.stderr]), bytes(buffers[status_pipe]), stopped
