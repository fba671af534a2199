"""rlvr.sandbox: what model-written code gets to do, and the attacks it must not get away with.

Each attack runs for real on this machine (no fake of the kernel): it must be contained, leave this
process alive, and return within its timeout plus a second. Where the kernel refuses namespaces the
isolated cases are skipped and the refusal is checked instead.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from rlvr import sandbox
from rlvr.sandbox import SandboxResult, SandboxUnavailable, run_python

ISOLATION_PROBLEM = sandbox.isolation_problem()
isolated = pytest.mark.skipif(ISOLATION_PROBLEM is not None, reason=f"no namespaces here: {ISOLATION_PROBLEM}")


def run_timed(code: str, timeout_s: float = 3, **kwargs) -> SandboxResult:
    start = time.monotonic()
    result = run_python(code, timeout_s=timeout_s, **kwargs)
    assert time.monotonic() - start <= timeout_s + 1, result
    return result


def sandbox_processes() -> list[int]:
    """Processes whose working directory is a sandbox's (deleted) temporary directory."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if "rlvr-sandbox-" in os.readlink(f"/proc/{pid}/cwd"):
                found.append(int(pid))
        except OSError:
            pass
    return found


def assert_no_process_left() -> None:
    deadline = time.monotonic() + 1
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_processes() == []


@isolated
def test_runs_code_with_stdin_files_and_its_own_directory():
    code = "import sys\nprint(sys.stdin.read().upper(), open('data/in.txt').read())\nopen('out.txt', 'w').write('x')"
    result = run_timed(code, stdin="abc", files={"data/in.txt": "given"})
    assert result == SandboxResult(stdout="ABC given\n", stderr="", returncode=0, timed_out=False, stopped=None)
    assert result.ok


@isolated
def test_exit_status_and_errors_are_passed_on():
    assert run_timed("import sys; sys.exit(3)").returncode == 3
    result = run_timed("raise ValueError('bad')")
    assert result.returncode == 1 and "ValueError: bad" in result.stderr and result.stopped is None


def test_files_must_stay_inside_its_directory():
    with pytest.raises(ValueError, match="relative path inside"):
        run_python("pass", files={"../escape.txt": "x"})
    with pytest.raises(ValueError, match="relative path inside"):
        run_python("pass", files={"/tmp/escape.txt": "x"})


@isolated
def test_fork_bomb_is_contained():
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = run_timed(code, timeout_s=2)
    assert result.timed_out and result.stopped == "timeout"
    assert_no_process_left()


@isolated
def test_infinite_loop_is_stopped_at_the_timeout():
    result = run_timed("while True:\n    pass\n", timeout_s=1)
    assert result.timed_out and result.returncode == -9
    assert_no_process_left()


@isolated
def test_allocating_10_gb_fails_inside():
    result = run_timed("x = bytearray(10 * 1024**3)\nprint('allocated')", memory_mb=256)
    assert result.stopped == "memory" and "allocated" not in result.stdout and result.returncode == 1


@isolated
def test_writing_outside_its_directory_fails(tmp_path):
    targets = [tmp_path / "escape.txt", f"/tmp/rlvr-escape-{uuid.uuid4().hex}", os.path.expanduser("~/rlvr-escape")]
    code = "\n".join(
        f"try:\n    open({str(t)!r}, 'w').write('x')\n    print('wrote', {str(t)!r})\nexcept OSError as e:\n"
        f"    print('refused', type(e).__name__)"
        for t in targets
    )
    result = run_timed(code)
    assert "wrote" not in result.stdout and result.stdout.count("refused") == len(targets)
    assert not any(os.path.exists(t) for t in targets)


@isolated
def test_trainer_environment_is_not_visible(monkeypatch):
    secret = uuid.uuid4().hex
    monkeypatch.setenv("RLVR_TEST_SECRET", secret)
    code = f"""
import os
import sys
print(dict(os.environ))
for pid in [{os.getpid()}, {os.getppid()}, 1, 'self']:
    try:
        print(open(f'/proc/{{pid}}/environ', 'rb').read())
    except OSError as e:
        print('refused', pid, type(e).__name__)
"""
    result = run_timed(code)
    assert result.ok and secret not in result.stdout
    assert f"refused {os.getpid()}" in result.stdout  # not in the code's /proc at all


@isolated
def test_no_network_even_to_localhost():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        code = (
            "import socket\ntry:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hello')\n"
            "    print('connected')\nexcept OSError as e:\n    print('refused', type(e).__name__)\n"
        )
        result = run_timed(code)
        assert "refused" in result.stdout and "connected" not in result.stdout
        with pytest.raises(BlockingIOError):
            server.accept()


@isolated
def test_killing_its_parent_leaves_the_trainer_alive():
    code = f"""
import os, signal
for pid in [{os.getpid()}, {os.getppid()}]:
    try:
        os.kill(pid, signal.SIGKILL)
        print('sent', pid)
    except OSError as e:
        print('refused', pid, type(e).__name__)
os.kill(os.getppid(), signal.SIGKILL)
print('still here')
"""
    result = run_timed(code)
    assert f"sent {os.getpid()}" not in result.stdout and f"refused {os.getpid()}" in result.stdout
    # getppid() is 0 in the code's PID namespace, whose PID 1 (the code) ignores that kill from inside.
    assert result.ok and result.stdout.endswith("still here\n")
    assert_no_process_left()


@isolated
def test_printing_1_gb_is_cut_at_the_cap():
    code = "import sys\nline = 'x' * 1_000_000\nfor _ in range(1000):\n    sys.stdout.write(line)\n"
    result = run_timed(code, timeout_s=5, max_output_bytes=100_000)
    assert result.stopped == "output_limit" and len(result.stdout) == 100_000 and not result.timed_out


@isolated
def test_ctypes_crash_is_a_signal_of_its_own():
    result = run_timed("import ctypes\nctypes.string_at(0)")
    assert result.returncode == -11 and result.stopped == "signal SIGSEGV"


@isolated
def test_a_file_cannot_grow_past_the_size_limit():
    # Python ignores SIGXFSZ, so the write fails instead of the process being stopped.
    code = f"import os\nf = open('big', 'wb')\ntry:\n    f.write(bytes({sandbox.MAX_FILE_BYTES + 1}))\n"
    code += "    f.flush()\nexcept OSError as e:\n    print(e.errno, os.path.getsize('big'))"
    result = run_timed(code)
    assert result.ok and result.stdout == f"27 {sandbox.MAX_FILE_BYTES}\n"


@isolated
def test_children_die_with_the_code():
    code = "import os, time\nif os.fork() == 0:\n    time.sleep(60)\nprint('parent done')"
    result = run_timed(code)
    assert result.ok and result.stdout == "parent done\n"
    assert_no_process_left()


def test_refuses_without_isolation_unless_opted_out():
    with sandbox.known_isolation_problem("user namespaces are switched off"):
        with pytest.raises(SandboxUnavailable, match="user namespaces are switched off.*require_isolation=False"):
            run_python("print(1)")
        if os.getuid() == 0:
            with pytest.raises(sandbox.SandboxError, match="would run as root"):
                run_python("print(1)", require_isolation=False)
        else:
            assert run_python("print(1)", require_isolation=False).stdout == "1\n"


def test_a_known_isolation_problem_holds_for_its_block_only():
    found = sandbox.isolation_problem()
    with sandbox.known_isolation_problem("user namespaces are switched off"):
        assert sandbox.isolation_problem() == "user namespaces are switched off"
    assert sandbox.isolation_problem() == found


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="positive"):
        run_python("pass", timeout_s=0)


@isolated
def test_its_directory_is_removed_even_when_it_locks_it():
    before = {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("rlvr-sandbox-")}
    result = run_timed("import os\nos.mkdir('d')\nopen('d/f', 'w').write('x')\nos.chmod('d', 0)\nos.chmod('.', 0)")
    assert result.ok
    assert {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("rlvr-sandbox-")} <= before


AS_NOBODY = """
import json, os, socket, sys, types
# rlvr's package imports torch, which this interpreter may lack: load the stdlib-only sandbox package alone.
package = types.ModuleType("rlvr")
package.__path__ = [sys.argv[1]]
sys.modules["rlvr"] = package
from rlvr import sandbox

server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen()
port = server.getsockname()[1]
code = f'''
import os, socket
out = []
for attempt in (lambda: open({sys.argv[2]!r}, "w"), lambda: socket.create_connection(("127.0.0.1", {port}), timeout=1),
                lambda: open("/proc/{os.getpid()}/environ", "rb").read()):
    try:
        attempt()
        out.append("done")
    except OSError as e:
        out.append(type(e).__name__)
print(",".join(out), os.getuid())
'''
result = sandbox.run_python(code)
bomb = sandbox.run_python("import os\\nwhile True:\\n    try:\\n        os.fork()\\n    except OSError:\\n        pass", timeout_s=2)
print(json.dumps({"problem": sandbox.isolation_problem(), "stdout": result.stdout, "bomb": bomb.stopped}))
"""


def _python_for_nobody() -> str | None:
    """An interpreter of this Python version that user nobody may run (the system's, typically)."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (f"/usr/bin/{version}", f"/usr/local/bin/{version}"):
        if os.path.isfile(candidate) and os.stat(candidate).st_mode & 0o001:
            return candidate
    return None


@isolated
@pytest.mark.skipif(os.getuid() != 0, reason="the user-namespace path is what runs here already")
def test_as_an_unprivileged_user_the_code_is_contained_through_a_user_namespace(tmp_path):
    """The same confinement when the trainer is not root (a user namespace instead of root's
    privileges): run a trainer as nobody, with the system's interpreter, on this kernel."""
    import json
    import shutil
    import subprocess

    python = _python_for_nobody()
    if python is None or shutil.which("setpriv") is None:
        pytest.skip("no setpriv, or no interpreter of this Python version that nobody may run")
    source = os.path.dirname(os.path.dirname(sandbox.__file__))  # the rlvr package, holding sandbox/
    ancestors = [source, *(str(p) for p in Path(source).parents)]
    readable = all(os.stat(p).st_mode & 0o001 for p in ancestors) and all(
        os.stat(p).st_mode & 0o004 for p in (source, sandbox.__file__, sandbox.LAUNCHER)
    )
    if not readable:
        pytest.skip("rlvr's source is not readable by nobody here")
    target = f"/tmp/rlvr-escape-{uuid.uuid4().hex}"
    command = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", python, "-I", "-c", AS_NOBODY]
    proc = subprocess.run([*command, source, target], capture_output=True, text=True, timeout=60, cwd="/")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["problem"] is None and report["bomb"] == "timeout"
    written, connected, environ = report["stdout"].split()[0].split(",")
    assert written == "OSError" and connected == "OSError" and environ in ("FileNotFoundError", "PermissionError")
    assert report["stdout"].split()[1] == "65534" and not os.path.exists(target)


@isolated
def test_a_fork_bomb_does_not_starve_a_call_running_beside_it():
    import threading

    bomb_code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    bomb = threading.Thread(target=run_python, args=(bomb_code,), kwargs={"timeout_s": 3})
    bomb.start()
    time.sleep(0.5)  # the bomb is at its process limit by now
    try:
        result = run_timed("import os\npid = os.fork()\nif pid == 0:\n    os._exit(0)\nos.waitpid(pid, 0)\nprint('ok')")
        assert result.ok and result.stdout == "ok\n"
    finally:
        bomb.join()
    assert_no_process_left()
