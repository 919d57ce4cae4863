"""Runs one program of model-written code, confined by the operating system, and reports its verdict.

Patching Python in the process that runs the code cannot confine it: ``posix.unlink``,
``os.posix_spawn``, ``ctypes`` and ``_socket`` reach the kernel directly. So each program runs
in a sandbox the kernel enforces:

- Linux: new user, pid, network, IPC and mount namespaces (bubblewrap, else util-linux
  ``unshare``) whose file system holds the system's programs and libraries and the Python
  prefixes, read-only, and one writable empty folder: no /etc, no home, no /proc, no /dev
  but null, zero and the random devices. No capability is kept, no network is reachable
  (no interface but the sandbox's own loopback), no process outside can be seen or
  signalled, and when the program's process ends the kernel kills every process it started.
- macOS: ``sandbox-exec`` with a profile that denies the network, writes outside the folder,
  reads under /Users, /Volumes and /private (home folders, /etc, other temporary folders),
  forking, running any program but the interpreter, and signalling other processes.

The harness is this file, run as ``python -I -c <this file's text>`` inside the sandbox: the
program comes on stdin, the verdict goes out on a pipe of its own, with a per-run nonce it
reads from another pipe only after the program has returned. Stdout and the exit status are
not trusted, so a program that prints ``passed`` and exits 0, or does so from an ``atexit``
hook or a ``__del__``, fails. A program written against this harness can still forge a pass
(the nonce's pipe is in its own process) or return an object that equals anything; see
docs/commands.md (``bench``, ``--score``).
"""

from __future__ import annotations

import functools
import io
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import NamedTuple, Optional

MEMORY_BYTES = 4 << 30
FILE_BYTES = 16 << 20  # the largest file a program may write
WORK_BYTES = 64 << 20  # all it may write (Linux: its folder is a tmpfs of this size)
PROCESSES = 16  # per user inside the sandbox (the kernel exempts root: run as root, the sandbox runs as NOBODY)
NOBODY = 65534
VERDICT_BYTES = 1 << 16
KINDS = {"linux": ("bwrap", "unshare"), "darwin": ("sandbox-exec",)}.get(sys.platform, ())
# What a Linux sandbox shows of the system, read-only (a top-level symlink such as /lib -> usr/lib is recreated).
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
DEVICES = ("null", "zero", "random", "urandom")
# macOS: the folders a program may not read (the interpreter's prefixes and its own folder excepted), and the
# sysctls it may (names starting so; kern.procargs2, which shows other processes' arguments and environment, is not).
PRIVATE = ("/Users", "/Volumes", "/private", "/etc", "/tmp", "/var")  # /private's contents, in either spelling
SYSCTLS = ("hw.", "machdep.cpu.", "kern.os", "kern.version", "kern.argmax", "kern.hostname", "kern.maxfilesperproc",
           "kern.secure_kernel", "kern.usrstack64", "kern.proc.pid.", "sysctl.proc_cputype", "vm.loadavg")


class Outcome(NamedTuple):
    passed: bool
    detail: str  # "passed", "timed out after 10 s", or the exception that stopped the program


class Jail(NamedTuple):
    """A sandbox that works here: its kind (one of KINDS), the tool's path, and whether the program runs as
    ``NOBODY`` (``unshare`` started by root: the kernel does not hold root to the process limit, even as the root
    of a user namespace, so root builds the namespaces itself and the program runs as nobody in them)."""

    kind: str
    tool: str
    nobody: bool = False


def jail(kind: str, path: Optional[str] = None) -> Optional[Jail]:
    """The sandbox ``kind`` when its tool is on ``path`` (default $PATH) and runs a program here, else None.

    Having the tool is not enough (user namespaces may be disabled, a profile refused), so a
    trivial program must pass in it. ``unshare`` started by root runs the program as ``NOBODY``
    where that works, else as the root of a user namespace, where the process limit does not bind.
    """
    tool = shutil.which(kind, path=path)
    if not tool:
        return None
    as_nobody = kind == "unshare" and os.geteuid() == 0
    return (as_nobody and _working(Jail(kind, tool, True))) or _working(Jail(kind, tool))


@functools.lru_cache(maxsize=None)
def _working(candidate: Jail) -> Optional[Jail]:
    return candidate if run("pass\n", 30, candidate).passed else None


def isolation(path: Optional[str] = None) -> Optional[Jail]:
    """The first sandbox of this platform's KINDS that works here, None when none does (as root, ``unshare``
    first: it can run the program as nobody)."""
    kinds = sorted(KINDS, key=lambda kind: kind != "unshare") if os.geteuid() == 0 else KINDS
    return next(filter(None, (jail(kind, path) for kind in kinds)), None)


def run(source: str, timeout: float, sandbox: Optional[Jail]) -> Outcome:
    """Runs ``source`` in ``sandbox`` (None: unconfined but for the limits) in an empty temporary folder.

    Every wait is bounded: at the timeout the process group is killed (in a Linux sandbox that
    kills everything the program started), and the verdict is what its pipe holds once the
    process has ended, never read up to the pipe's end, which a leftover process could hold open.
    """
    nonce = os.urandom(16).hex()
    with tempfile.TemporaryDirectory(prefix="dflash-score-", ignore_cleanup_errors=True) as folder:
        os.mkdir(os.path.join(folder, "work"))
        os.mkdir(os.path.join(folder, "root"))
        command, inside = wrap(sandbox, folder, [sys.executable, "-I", "-c", _harness(), str(math.ceil(timeout) + 1)])
        env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": inside, "TMPDIR": inside, "LANG": "C.UTF-8",
               "OMP_NUM_THREADS": "1"}
        nonce_in, nonce_out = os.pipe()
        os.write(nonce_out, nonce.encode())
        os.close(nonce_out)
        verdict_in, verdict_out = os.pipe()
        try:
            with open(os.path.join(folder, "stderr"), "w+b") as err:
                try:
                    child = subprocess.Popen(command + [str(nonce_in), str(verdict_out)], stdin=subprocess.PIPE,
                                             stdout=subprocess.DEVNULL, stderr=err, cwd=os.path.join(folder, "work"),
                                             env=env, start_new_session=True, pass_fds=(nonce_in, verdict_out))
                finally:
                    os.close(nonce_in)
                    os.close(verdict_out)
                timed_out = _finish(child, source.encode(), timeout)
                os.set_blocking(verdict_in, False)
                try:
                    verdict = os.read(verdict_in, VERDICT_BYTES).decode(errors="replace")
                except BlockingIOError:
                    verdict = ""
                err.seek(max(0, os.fstat(err.fileno()).st_size - 4096))
                errors = err.read().decode(errors="replace").strip().splitlines()
        finally:
            os.close(verdict_in)
    if timed_out:
        return Outcome(False, f"timed out after {timeout:g} s")
    said = next((line[len(nonce) + 1:] for line in verdict.splitlines() if line.startswith(nonce + " ")), "")
    if said == "passed":
        return Outcome(True, "passed")
    if said.startswith("failed "):
        detail = said[len("failed "):]  # only a pass may read "passed" (bench.print_score compares the text)
        return Outcome(False, "failed: passed" if detail == "passed" else detail)
    return Outcome(False, f"exit status {child.returncode}" + (f": {errors[-1]}" if errors else ""))


def _finish(child: subprocess.Popen, source: bytes, timeout: float) -> bool:
    """Feeds the program and waits for the process up to ``timeout``; True when it had to be killed."""
    try:
        child.communicate(source, timeout=timeout)
        return False
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        try:
            child.wait(timeout=5)
        except subprocess.TimeoutExpired:  # a process stuck in the kernel: the run is over all the same
            pass
        return True


@functools.lru_cache(maxsize=1)
def _harness() -> str:
    with open(__file__, encoding="utf-8") as f:
        return f.read()


def wrap(sandbox: Optional[Jail], folder: str, argv: list[str]) -> tuple[list[str], str]:
    """The command that runs ``argv`` in ``sandbox``, and the path of the writable folder as the program sees it.

    ``folder`` is this run's temporary folder, with two empty subfolders: ``work``, the one the
    program may write (its working folder), and ``root``, where ``unshare`` builds the sandbox's
    file system (in its own mount namespace: nothing appears there outside).
    """
    work, root = os.path.join(folder, "work"), os.path.join(folder, "root")
    if sandbox is None:
        return argv, work
    if sandbox.kind == "sandbox-exec":
        prefixes, works = spellings(interpreter()), spellings([work])
        params = [f"P{i}={p}" for i, p in enumerate(prefixes)] + [f"W{i}={p}" for i, p in enumerate(works)]
        return [sandbox.tool, *(a for p in params for a in ("-D", p)), "-p", profile(len(prefixes), len(works)),
                *argv], os.path.realpath(work)
    # The sandbox's /tmp is a tmpfs of WORK_BYTES, mounted before the read-only folders so that an interpreter
    # under /tmp (a CI's clone) shows inside it; the program starts in an empty folder of its own there.
    links, binds = _tree()
    if sandbox.kind == "bwrap":
        view = [a for target, link in links for a in ("--symlink", target, link)]
        view += [a for path in binds for a in ("--ro-bind", path, path)]
        return [sandbox.tool, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session",
                "--cap-drop", "ALL", "--size", str(WORK_BYTES), "--tmpfs", "/tmp", "--dir", "/tmp/run", *view,
                "--dev", "/dev", "--chdir", "/tmp/run", "--", *argv], "/tmp/run"
    user = [] if sandbox.nobody else ["--user", "--map-root-user"]
    return [sandbox.tool, *user, "--net", "--pid", "--ipc", "--mount", "--fork", "--kill-child", "/bin/sh", "-c",
            unshare_script(root, links, binds, sandbox.nobody), "sh", *argv], "/tmp/run"


def interpreter() -> list[str]:
    """Where the interpreter's files are: all a program needs besides the system's."""
    return [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
            os.path.dirname(os.path.realpath(sys.executable))]


def readable() -> list[str]:
    """The interpreter's folders as real paths, none inside another (nor the root)."""
    prefixes = {os.path.realpath(p) for p in interpreter()}
    return [p for p in sorted(prefixes) if p != "/" and not any(p.startswith(q.rstrip("/") + "/") for q in prefixes)]


def spellings(paths: list[str]) -> list[str]:
    """Each path as written and resolved, and with or without /private: macOS's sandbox matches the spelling."""
    found = []
    for path in (form for p in paths for form in (os.path.abspath(p), os.path.realpath(p))):
        found.append(path)
        for short in ("/etc", "/tmp", "/var"):
            if path == "/private" + short or path.startswith(f"/private{short}/"):
                found.append(path[len("/private"):])
            elif path == short or path.startswith(short + "/"):
                found.append("/private" + path)
    return [p for p in dict.fromkeys(found) if p != "/"]


def _tree() -> tuple[list[tuple[str, str]], list[str]]:
    """A Linux sandbox's file system: (symlink target, symlink) pairs and folders to show read-only."""
    links = [(os.readlink(p), p) for p in SYSTEM if os.path.islink(p)]
    binds = [p for p in SYSTEM if os.path.isdir(p) and not os.path.islink(p)]
    return links, binds + [p for p in readable() if not any(p == b or p.startswith(b + "/") for b in binds)]


def unshare_script(root: str, links: list[tuple[str, str]], binds: list[str], nobody: bool = False) -> str:
    """The shell run as root of the new namespaces: builds the sandbox's root on a tmpfs at ``root``, enters it;
    with ``nobody`` the program then runs as ``NOBODY`` (root's namespaces, without a user namespace of their own).

    Each folder is bind-mounted, then made read-only keeping the flags (nosuid, nodev, noexec)
    of the mount it comes from (the kernel refuses to drop them inside a user namespace). The
    old root is detached, and setpriv drops every capability before the program starts, so the
    program cannot undo any of it.
    """
    q = shlex.quote
    lines = ["set -eu", "PATH=/usr/sbin:/usr/bin:/sbin:/bin",  # pivot_root is in sbin, which a user's PATH may lack
             f"mount -t tmpfs -o size=1m,mode=755 dflash {q(root)}", f"cd {q(root)}", "mkdir .old proc tmp dev",
             f"mount -t tmpfs -o size={WORK_BYTES},mode=1777 dflash-work tmp", "mkdir -m 777 tmp/run"]
    lines += [f"ln -s {q(target)} .{q(link)}" for target, link in links]
    for path in binds:
        lines += [f"mkdir -p .{q(path)}", f"mount --bind {q(path)} .{q(path)}",
                  f"mount -o remount,bind,ro{_locked(path)} .{q(path)}"]
    for name in DEVICES:
        lines += [f"touch dev/{name}", f"mount --bind /dev/{name} dev/{name}"]
    lines += ["pivot_root . .old",
              "mount -t proc proc /proc", "umount -l /.old", "umount /proc", "rmdir /.old /proc",
              "mount -o remount,bind,ro /", "cd /tmp/run",
              "exec setpriv " + (f"--reuid={NOBODY} --regid={NOBODY} --clear-groups --pdeathsig keep " if nobody
                                 else "")  # (a change of user clears the kill that --kill-child set: kept)
              + '--bounding-set=-all --inh-caps=-all --no-new-privs "$@"']
    return "\n".join(lines) + "\n"


def _locked(path: str) -> str:
    flags = os.statvfs(path).f_flag
    return "".join(f",{name}" for bit, name in ((os.ST_NOSUID, "nosuid"), (os.ST_NODEV, "nodev"),
                                                 (os.ST_NOEXEC, "noexec")) if flags & bit)


def profile(prefixes: int, works: int) -> str:
    """The macOS sandbox profile; paths come as ``-D`` parameters P0.. (the interpreter's) and W0.. (the folder's).

    Parameters keep paths out of the profile's syntax (no quoting). Everything not allowed is
    denied, and no rule overrides another, so the order in which rules apply does not matter.
    Denied by default, among the rest: the network (AF_UNIX sockets included), forking,
    mach-lookup (the services that would run work outside the sandbox), shared memory.
    """
    ours = " ".join(f'(subpath (param "P{i}"))' for i in range(prefixes))
    work = " ".join(f'(subpath (param "W{i}"))' for i in range(works))
    private = " ".join(f'(subpath "{p}")' for p in PRIVATE)
    sysctls = " ".join(f'(sysctl-name-prefix "{name}")' for name in SYSCTLS)
    return "\n".join([
        "(version 1)",
        "(deny default)",
        f"(allow process-exec {ours})",
        "(allow process-info* (target self))",
        "(allow signal (target self))",
        f"(allow sysctl-read {sysctls})",
        "(allow file-read-metadata file-test-existence)",
        f"(allow file-read* file-map-executable (require-any (require-not (require-any {private})) {ours} {work}))",
        f"(allow file-write* {work})",
        '(allow file-write-data (literal "/dev/null"))',
    ]) + "\n"


# The harness: everything below runs inside the sandbox.

def _limit(seconds: int) -> None:
    import resource

    for limit, value in ((resource.RLIMIT_AS, MEMORY_BYTES), (resource.RLIMIT_CPU, seconds),
                         (resource.RLIMIT_FSIZE, FILE_BYTES), (resource.RLIMIT_NPROC, PROCESSES)):
        try:
            resource.setrlimit(limit, (value, value))
        except (ValueError, OSError):  # macOS refuses RLIMIT_AS; the parent's timeout still holds
            pass


def _refuse(*args: object, **kwargs: object) -> None:
    raise OSError("disabled while scoring generated code")


def _disable() -> None:
    """What HumanEval's harness disables, so that pass@1 means what it does there (the sandbox is the boundary)."""
    import socket

    for name in ("socket", "create_connection", "getaddrinfo", "socketpair", "fromfd"):
        setattr(socket, name, _refuse)
    for name in ("system", "kill", "killpg", "fork", "forkpty", "execv", "execve", "execvp", "spawnv", "popen",
                 "remove", "unlink", "rmdir", "removedirs", "rename", "renames", "replace", "truncate", "chmod",
                 "chown", "chroot", "putenv", "setuid"):
        if hasattr(os, name):
            setattr(os, name, _refuse)
    shutil.rmtree = shutil.move = _refuse
    subprocess.Popen = _refuse  # type: ignore[assignment,misc]


def main() -> None:
    """argv: seconds of CPU and of wall clock, the nonce's pipe, the verdict's pipe; the program on stdin.

    Writes ``<nonce> passed`` or ``<nonce> failed <the exception>`` and ends the process at once, so
    no ``atexit`` hook, ``__del__`` or thread of the program runs after the verdict.
    """
    seconds, nonce_fd, verdict_fd = (int(a) for a in sys.argv[1:4])
    read, write, end = os.read, os.write, os._exit  # the program may replace os's
    program = sys.stdin.read()
    sys.stdin = io.StringIO()
    try:
        os.setsid()  # a signal to the program's own process group reaches no process outside
    except OSError:  # already a session leader
        pass
    signal.signal(signal.SIGALRM, lambda *_: end(1))  # should the parent die; a handler, since a pid
    signal.alarm(seconds)  # namespace's init (this process, under unshare) ignores a signal it has none for
    _limit(seconds)
    _disable()
    try:
        exec(compile(program, "<completion>", "exec"), {"__name__": "__main__"})
        verdict = "passed"
    except BaseException as e:  # noqa: BLE001 - any way out of the program is a failure, SystemExit included
        message = str(e).splitlines()[0] if str(e).strip() else ""
        verdict = f"failed {type(e).__name__}{': ' + message if message else ''}"[:300]
    write(verdict_fd, read(nonce_fd, 64) + b" " + verdict.encode(errors="replace") + b"\n")
    end(0)


if __name__ == "__main__":
    main()
