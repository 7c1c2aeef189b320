"""What the two launchers share: ``course.mpi`` (MPI ranks) and ``course.dist``
(torch.distributed processes). A job of N processes, its result, and how to
stop it — every process, whatever session or group it put itself in.
"""
from __future__ import annotations

import os
import pickle
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

_TOOLKIT = str(Path(__file__).parent)

# What a hung job of each kind is usually waiting for.
_HANGS = {
    "MPI": "A blocking send or receive that no other rank matches waits forever",
    "torch": "A collective that not every rank calls (or calls in another order), or a send no one receives, "
             "waits forever",
}


class JobError(RuntimeError):
    """A job did not finish on every rank; ``str()`` says why."""

    def __init__(self, job: "Job"):
        super().__init__(job.explain())
        self.job = job
        self.status = job.status  # the grader reports "timeout" as such


@dataclass
class Job:
    n: int
    status: str  # ok, timeout, raised, not_implemented, crashed
    results: list = field(default_factory=list)  # per rank; None where a rank returned nothing
    errors: dict = field(default_factory=dict)  # rank -> "Type: message" for ranks that raised
    finished: list = field(default_factory=list)  # ranks that returned or raised
    output: str = ""  # the tail of what the ranks printed
    duration_s: float = 0.0
    timeout_s: float = 0.0
    kind: str = "MPI"
    killed: dict = field(default_factory=dict)  # rank -> signal name, for ranks a signal ended (torch jobs)
    idle_s: float = 0.0  # > 0: stopped early, its processes idle this long (course.dist's idle_timeout)
    wire: dict | None = None  # what crossed between the ranks, as the kernel counted it (course.wire)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def explain(self) -> str:
        if self.status == "ok":
            return f"{self.n} ranks finished in {self.duration_s:.2f} s"
        if self.status == "timeout":
            waiting = [r for r in range(self.n) if r not in self.finished]
            stopped = (f"stopped after {self.duration_s:.0f} s, no rank having used the CPU for {self.idle_s:g} s"
                       if self.idle_s else f"timed out after {self.timeout_s:g} s")
            return (f"{stopped}: likely deadlock — rank(s) {waiting} never finished "
                    f"(finished: {self.finished or 'none'}); every rank was stopped. {_HANGS[self.kind]}")
        if self.killed:  # a crash inside a library (gloo aborting, say): the others' errors follow from it
            rank, signame = next(iter(self.killed.items()))
            tail = self.output.strip().splitlines()[-5:]
            return (f"rank {rank} of {self.n} was ended by {signame} (a crash inside a library, not a Python "
                    "exception)" + ("\n  last output: " + "\n  ".join(tail) if tail else ""))
        if self.errors:
            rank = next(iter(self.errors))  # the first to fail; the others often fail because of it
            return f"rank {rank} of {self.n} raised {self.errors[rank]}"
        tail = self.output.strip().splitlines()[-5:]
        return (f"the {self.kind} job ended before every rank returned (ranks that finished: "
                f"{self.finished or 'none'})" + ("\n  last output: " + "\n  ".join(tail) if tail else ""))

    def check(self) -> "Job":
        """Return the job if every rank finished, else raise (NotImplementedError for a stub)."""
        if self.status == "not_implemented":
            raise NotImplementedError(next(iter(self.errors.values())).split(": ", 1)[-1])
        if not self.ok:
            raise JobError(self)
        return self

    def read_replies(self, folder: Path) -> None:
        """Fill in results and errors from the ``rank-N.pkl`` files the ranks wrote,
        in the order they were written."""
        replies = [(Path(folder) / f"rank-{rank}.pkl", rank) for rank in range(self.n)]
        replies = sorted(((f.stat().st_mtime_ns, rank, f) for f, rank in replies if f.exists()))
        for _, rank, reply in replies:
            kind, value = pickle.loads(reply.read_bytes())
            if kind == "ok":
                self.results[rank] = value
            else:
                self.errors[rank] = value
                if kind == "not_implemented" and self.status == "ok":
                    self.status = "not_implemented"
        self.finished = sorted(rank for _, rank, _ in replies)

    def settle(self, timed_out: bool, clean_exit: bool) -> "Job":
        if timed_out:
            self.status = "timeout"
        elif self.killed:
            self.status = "crashed"
        elif self.errors and self.status == "ok":
            self.status = "raised"
        elif self.status == "ok" and (len(self.finished) < self.n or not clean_exit):
            self.status = "crashed"
        return self


def target_name(target) -> str:
    """``"module:qualname"`` for a function the ranks can import, or a readable error."""
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None)
    if module in (None, "__main__") or "<locals>" in getattr(target, "__qualname__", "<locals>"):
        raise ValueError(
            f"{getattr(target, '__name__', target)!r} is defined in a notebook or script's __main__ (or inside "
            "a function), which the ranks cannot import: each rank is a new Python process. Put it in a .py "
            "module next to the notebook and import it from there")
    return f"{module}:{target.__qualname__}"


def load_target(name: str):
    """The function named ``"module:qualname"`` or ``"path/to/file.py:qualname"``."""
    import importlib
    import importlib.util

    module, _, qualname = name.rpartition(":")
    if module.endswith(".py"):  # a file by path, e.g. a lab's grading harness
        spec = importlib.util.spec_from_file_location(Path(module).stem, module)
        fn = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(fn)
    else:
        fn = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    return fn


def worker_env() -> dict:
    """The caller's environment for the ranks: its sys.path (a module next to the
    notebook imports), one thread per process (several ranks share few cores)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([p or os.getcwd() for p in sys.path if isinstance(p, str)])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("NUMBA_NUM_THREADS", "1")
    return env


def call_and_reply(call, reply: Path) -> bool:
    """Run ``call()`` and pickle ``(kind, value)`` to ``reply``; False when it raised."""
    def write(answer):  # whole or not at all: the launcher may kill the job at any moment
        reply.with_suffix(".tmp").write_bytes(pickle.dumps(answer))
        reply.with_suffix(".tmp").rename(reply)

    try:
        value = call()
        write(("ok", value))
        return True
    except NotImplementedError as exc:
        write(("not_implemented", f"NotImplementedError: {exc}"))
    except BaseException as exc:  # noqa: BLE001 - reported, then the job is ended
        frames = traceback.extract_tb(exc.__traceback__)
        # Point at the caller's code, not at this toolkit's (e.g. the audited communicator) or a library's.
        where = next((f for f in reversed(frames) if not f.filename.startswith(_TOOLKIT)
                      and not f.filename.endswith(".pyx") and "site-packages" not in f.filename), frames[-1])
        write(("raised", f"{type(exc).__name__}: {exc} (at {Path(where.filename).name}:{where.lineno})"))
    return False


def kill_tree(proc, patience_s: float = 5.0) -> None:
    """Kill ``proc``, its process group and every process below it, and return once
    they are gone. A group kill alone is not enough: MPICH's proxies put themselves
    in groups of their own. Each is stopped before any is killed, so none forks
    while we look, nor outlives its killed parent unseen as an orphan."""
    doomed: list[int] = []
    while fresh := [pid for pid in [proc.pid, *descendants(proc.pid)] if pid not in doomed]:
        for pid in fresh:
            try:
                os.kill(pid, signal.SIGSTOP)
            except OSError:
                pass
        doomed += fresh
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    proc.wait()
    # A killed process takes a moment to exit (unmapping a torch rank's memory, on a busy machine).
    deadline = time.monotonic() + patience_s
    while any(alive(pid) for pid in doomed[1:]) and time.monotonic() < deadline:
        time.sleep(0.01)


def alive(pid: int) -> bool:
    """``pid`` exists and has not yet exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def descendants(root: int) -> list[int]:
    """Every process below ``root`` in the process tree (Linux /proc; elsewhere none)."""
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
