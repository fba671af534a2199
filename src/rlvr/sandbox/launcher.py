"""The process that shuts model-written code in before running it (``rlvr.sandbox`` starts it).

Run as ``python -I -S launcher.py SETTINGS_JSON`` with the status pipe's write end as an
inherited file descriptor. Only the standard library is used, and nothing of rlvr, so that it starts
fast and runs under any interpreter.

With ``isolate`` it enters new mount, PID and network namespaces (and a user namespace when it is not
root), then forks: the child is PID 1 of the new PID namespace, so when it ends the kernel kills
every process the code started, and it dies with the launcher (parent-death signal). The child
mounts a /proc of its own namespace (the trainer's processes and their environments are not in it),
makes every mount read-only but the working directory, becomes an unprivileged user (so that the
process limit holds and no capability is left), sets the resource limits and execs Python on
``main.py`` with an empty environment.

It reports on the status pipe: ``ok`` just before the exec (the pipe closes on exec), or one line
``error: <why>`` when it could not set something up; the code never runs then. The launcher passes the
child's end on: its exit status, or the same signal on itself.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import select
import signal
import stat
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
MS_STRICTATIME = 1 << 24
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
NOBODY = 65534
"""The code's user id inside a user namespace (the trainer is not root): the conventional ``nobody``."""
# A mount's flags as statvfs reports them, and the mount flag that keeps each on a remount.
KEPT_MOUNT_FLAGS = {
    os.ST_NOSUID: MS_NOSUID,
    os.ST_NODEV: MS_NODEV,
    os.ST_NOEXEC: MS_NOEXEC,
    os.ST_NOATIME: MS_NOATIME,
    os.ST_NODIRATIME: MS_NODIRATIME,
    os.ST_RELATIME: MS_RELATIME,
}
RESOURCE_LIMITS = {
    "cpu_s": resource.RLIMIT_CPU,
    "address_space_bytes": resource.RLIMIT_AS,
    "processes": resource.RLIMIT_NPROC,
    "file_size_bytes": resource.RLIMIT_FSIZE,
    "open_files": resource.RLIMIT_NOFILE,
    "core_bytes": resource.RLIMIT_CORE,
}

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """A step of the confinement that failed; the code is not run."""


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encode = lambda s: None if s is None else s.encode()
    _check(_libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)), f"mount {target}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _mount_points() -> list[str]:
    """Every mount point of this mount namespace, in mount order (fifth field of mountinfo, octal
    escapes undone)."""
    with open("/proc/self/mountinfo", "rb") as f:
        fields = [line.split()[4] for line in f]
    return [field.decode("unicode_escape").encode("latin-1").decode() for field in fields]


def _remount_read_only(path: str) -> None:
    flags = os.statvfs(path).f_flag
    if flags & os.ST_RDONLY:
        return
    # A mount inherited into a user namespace keeps its locked flags only if they are passed again.
    kept = sum(mount_flag for st_flag, mount_flag in KEPT_MOUNT_FLAGS.items() if flags & st_flag)
    atime = 0 if kept & (MS_NOATIME | MS_RELATIME) else MS_STRICTATIME
    _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept | atime)


def _make_read_only_but(workdir: str) -> None:
    for point in _mount_points():
        if point == workdir or not os.path.isdir(point):
            continue
        try:
            _remount_read_only(point)
        except (SetupError, OSError):
            pass  # hidden under a later mount; checked below through what is reachable
    for point in _mount_points():
        if point != workdir and os.path.isdir(point) and not os.statvfs(point).f_flag & os.ST_RDONLY:
            raise SetupError(f"could not make {point} read-only")


def _expose_interpreter(prefix: str) -> None:
    """Make the interpreter's installation reachable by the unprivileged user: an ancestor it may not
    enter (a home folder of mode 700) is covered, in this mount namespace only, by an empty tmpfs
    that holds only the installation, bound back at its own path."""
    parts = prefix.strip("/").split("/")
    closed = None
    for i in range(1, len(parts) + 1):
        path = "/" + "/".join(parts[:i])
        if not os.stat(path).st_mode & stat.S_IXOTH:
            closed = path
            break
    if closed is None:
        return
    handle = os.open(prefix, os.O_PATH | os.O_DIRECTORY)
    _mount("tmpfs", closed, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=64k")
    os.makedirs(prefix, mode=0o755, exist_ok=True)
    _mount(f"/proc/self/fd/{handle}", prefix, None, MS_BIND | MS_REC)
    os.close(handle)


def _enter_namespaces() -> None:
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET
    if uid != 0:
        flags |= CLONE_NEWUSER
    _check(_libc.unshare(flags), "unshare (new namespaces)")
    if uid != 0:
        # The code's user id inside is not root's, so exec leaves it no capability.
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{NOBODY} {uid} 1")
        _write("/proc/self/gid_map", f"{NOBODY} {gid} 1")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)


def _confine_child(settings: dict) -> None:
    """In PID 1 of the new namespace: /proc, read-only mounts, the interpreter, the user (as root, the
    call's own unprivileged ``settings["uid"]``, so that the process limit counts this call's
    processes only)."""
    workdir = settings["workdir"]
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _mount(workdir, workdir, None, MS_BIND)
    root = os.getuid() == 0
    if root:
        _expose_interpreter(settings["prefix"])
    _make_read_only_but(workdir)
    if root:
        for dirpath, dirnames, filenames in os.walk(workdir):
            for name in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
                os.chown(name, settings["uid"], settings["uid"])
        os.setgroups([])
        os.setresgid(settings["uid"], settings["uid"], settings["uid"])
        os.setresuid(settings["uid"], settings["uid"], settings["uid"])


def _set_limits(limits: dict) -> None:
    for name, value in limits.items():
        soft, hard = value if isinstance(value, list) else (value, value)
        resource.setrlimit(RESOURCE_LIMITS[name], (soft, hard))


def _exec_code(settings: dict, status: int, launcher_alive: int) -> None:
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(no_new_privs)")
    if launcher_alive >= 0:
        # Set after the change of user, which clears it.
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(pdeathsig)")
        # The launcher may have died before that: its end of this pipe is then closed.
        if select.select([launcher_alive], [], [], 0)[0]:
            os._exit(1)
    _set_limits(settings["limits"])
    os.chdir(settings["workdir"])
    if settings.get("probe"):
        os.write(status, b"ok\n")
        os._exit(0)
    python = settings["python"]
    os.write(status, b"ok\n")
    os.execve(python, [python, "-I", "-S", "-B", "main.py"], {})


def _pass_on(child: int) -> None:
    _, wait_status = os.waitpid(child, 0)
    if os.WIFSIGNALED(wait_status):
        sig = os.WTERMSIG(wait_status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(wait_status))


def main() -> None:
    settings = json.loads(sys.argv[1])
    status = settings["status_fd"]
    os.set_inheritable(status, False)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:
        # Dies with the trainer (the code dies with the launcher), and not after it already did.
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(pdeathsig)")
        if os.getppid() != settings["parent_pid"]:
            os._exit(1)
        if settings["isolate"]:
            _enter_namespaces()
            launcher_alive, launcher_end = os.pipe()
            child = os.fork()
            if child:
                os.close(status)
                _pass_on(child)
            os.close(launcher_end)
            _confine_child(settings)
        elif os.getuid() == 0:
            raise SetupError("without namespaces the code would run as root; run the trainer as another user")
        else:
            launcher_alive = -1
        _exec_code(settings, status, launcher_alive)
    except (SetupError, OSError) as e:
        os.write(status, f"error: {e}\n".encode())
        os._exit(1)


if __name__ == "__main__":
    main()
