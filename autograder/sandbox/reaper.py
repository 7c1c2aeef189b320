"""The process side of isolation (``autograder.sandbox.isolation``): leaving root for
``nobody``, and the supervisor of the ``subreaper`` layer.

``drop_privileges`` runs first thing in every sandboxed child, before it reads
its request: from then on it has no groups, no capabilities and no way to gain
privileges again (``PR_SET_NO_NEW_PRIVS``).

``python -m autograder.sandbox.reaper --exec-as UID:GID -- COMMAND…`` becomes that
user, then COMMAND (the readiness proof's fresh interpreter).

``python -m autograder.sandbox.reaper -- COMMAND…`` is the supervisor for machines
without namespaces. It makes itself a child subreaper
(``PR_SET_CHILD_SUBREAPER``), so every process the student's code starts comes
back to it when its parent dies, however it double-forks or ``setsid``s. It
starts COMMAND, waits for it, then kills and reaps everything left before it
leaves with COMMAND's status (128 + N when a signal N ended it, as bubblewrap
reports it). It stays the grader's user: the student's processes, as
``nobody``, cannot signal it. Inside bubblewrap's PID namespace the kernel does
all this by itself when the namespace's first process ends.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
_libc = ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, value: int) -> None:
    if _libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


def drop_privileges(run_as: str) -> None:
    """Become ``"UID:GID"`` (or stay, for ``""``) and never gain privileges again."""
    if run_as:
        uid, gid = map(int, run_as.split(":"))
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)  # the kernel clears every capability with it
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # and the parent-death signal, which we want back
    _prctl(PR_SET_NO_NEW_PRIVS, 1)  # no setuid program gives them back


def kill_and_reap_all() -> None:
    """SIGKILL every descendant until none is left; orphans keep coming back to us."""
    from course.jobs import descendants

    while True:
        for pid in descendants(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.002)


def exec_as(run_as: str, command: list[str]) -> int:
    """Become ``run_as`` ("UID:GID"), then become ``command``: a program started as the
    student's user from its first instruction (autograder.sandbox.readiness). Returns
    only when it cannot be started: 126, as a shell says "found but cannot run"."""
    drop_privileges(run_as)
    try:
        os.execv(command[0], command)
    except OSError as exc:
        print(f"cannot run {command[0]} as uid {run_as.split(':')[0]}: {exc.strerror}", file=sys.stderr)
    return 126


def main(argv: list[str]) -> int:
    if argv[:1] == ["--exec-as"]:
        _, run_as, sep, *command = argv
        assert sep == "--" and command, "usage: python -m autograder.sandbox.reaper --exec-as UID:GID -- COMMAND…"
        return exec_as(run_as, command)
    sep, *command = argv
    assert sep == "--" and command, "usage: python -m autograder.sandbox.reaper -- COMMAND…"
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # dies with the grader
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    fds = tuple(int(fd) for fd in os.environ.get("K2C_PASS_FDS", "").split(",") if fd)
    child = subprocess.Popen(command, pass_fds=fds,
                             preexec_fn=lambda: _prctl(PR_SET_PDEATHSIG, signal.SIGKILL))
    for fd in fds:
        os.close(fd)  # the result pipe must close when the child's end does
    code = child.wait()
    kill_and_reap_all()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
