"""Runs one program of model-written code; started by score.py as ``python -I sandbox.py``, never imported.

The program comes on stdin. It runs in a fresh interpreter (isolated mode: no user site,
no PYTHON* variables) whose working folder is an empty temporary one, with memory and CPU
limits, no sockets, and the calls that delete files, start processes or signal other
processes disabled, as the HumanEval harness does. This guards against accidents (a
completion that deletes a file, loops, or fetches a URL), not against a program written to
escape: run untrusted models' code inside a VM or container.

Exit status 0 and ``passed`` on stdout: the program ran to its end. Otherwise exit status 1
and one line on stderr: the exception that stopped it.
"""

from __future__ import annotations

import io
import os
import sys

MEMORY_BYTES = 4 << 30


def _limit(cpu_seconds: int) -> None:
    import resource

    for limit, value in ((resource.RLIMIT_AS, MEMORY_BYTES), (resource.RLIMIT_CPU, cpu_seconds)):
        try:
            resource.setrlimit(limit, (value, value))
        except (ValueError, OSError):  # macOS refuses RLIMIT_AS; the parent's timeout still holds
            pass


def _refuse(*args: object, **kwargs: object) -> None:
    raise OSError("disabled while scoring generated code")


def _disable() -> None:
    """No network, no new processes, no deleting or renaming files, no signals to other processes."""
    import shutil
    import socket
    import subprocess

    for name in ("socket", "create_connection", "getaddrinfo", "socketpair", "fromfd"):
        setattr(socket, name, _refuse)
    for name in ("system", "kill", "killpg", "fork", "forkpty", "execv", "execve", "execvp", "spawnv", "popen",
                 "remove", "unlink", "rmdir", "removedirs", "rename", "renames", "replace", "truncate", "chmod",
                 "chown", "chroot", "putenv", "setuid"):
        if hasattr(os, name):
            setattr(os, name, _refuse)
    shutil.rmtree = shutil.move = _refuse
    subprocess.Popen = _refuse  # type: ignore[assignment,misc]


def main() -> int:
    program = sys.stdin.read()
    out = os.fdopen(os.dup(1), "w")
    _limit(int(sys.argv[1]) if len(sys.argv) > 1 else 10)
    _disable()
    sys.stdin = io.StringIO()
    sys.stdout = sys.stderr = io.StringIO()  # the program's prints are not the verdict
    try:
        exec(compile(program, "<completion>", "exec"), {"__name__": "__main__"})
    except BaseException as e:  # noqa: BLE001 - any way out of the program is a failure, SystemExit included
        message = str(e).splitlines()[0] if str(e) else ""
        sys.__stderr__.write(f"{type(e).__name__}{': ' + message if message else ''}\n")
        return 1
    out.write("passed\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
