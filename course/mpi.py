"""Run a function or a script on N MPI ranks — from a notebook, a lab or the grader.

    from course import mpi
    job = mpi.run("heat:step_many", 4, u0, 10, timeout=30)   # or a function object
    job.results        # what each rank returned, by rank
    job.check()        # raise a readable error unless every rank finished

``target`` is a function, ``"module:function"`` or ``"path/to/file.py:function"``.
``run(target, n, *args)`` starts ``mpiexec -n n`` with *this* interpreter and
*this* environment's ``mpiexec`` (``sys.prefix/bin``), never whatever comes
first on PATH, so a notebook kernel needs nothing activated. Every rank calls
``target(comm, *args, **kwargs)`` with ``comm = MPI.COMM_WORLD`` (communicators
are passed explicitly: nothing hides which processes talk) and sends back what
it returns. ``run_script(path, n)`` runs a script as it is.

A job never outlives its timeout: mpiexec and every rank run in a process
group of their own, which is killed when time is up — the usual end of a
deadlock — and the result says which ranks had finished. When a rank raises,
it reports the error and aborts the job, so the others do not wait forever for
a message that will never come.

The target must be importable by the ranks (a function in a ``.py`` module, not
one defined in a notebook: each rank is a fresh interpreter that cannot see the
notebook's ``__main__``). ``cwd`` and ``sys.path`` of the caller are passed on,
so a module next to the notebook works.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path


class MPIJobError(RuntimeError):
    """An MPI job did not finish on every rank; ``str()`` says why."""

    def __init__(self, job: "MPIJob"):
        super().__init__(job.explain())
        self.job = job
        self.status = job.status  # the grader reports "timeout" as such


@dataclass
class MPIJob:
    n: int
    status: str  # ok, timeout, raised, not_implemented, crashed
    results: list = field(default_factory=list)  # per rank; None where a rank returned nothing
    errors: dict = field(default_factory=dict)  # rank -> "Type: message" for ranks that raised
    finished: list = field(default_factory=list)  # ranks that returned or raised
    output: str = ""  # the tail of what the ranks printed
    duration_s: float = 0.0
    timeout_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def explain(self) -> str:
        if self.status == "ok":
            return f"{self.n} ranks finished in {self.duration_s:.2f} s"
        if self.status == "timeout":
            waiting = [r for r in range(self.n) if r not in self.finished]
            return (f"timed out after {self.timeout_s:g} s: likely deadlock — rank(s) {waiting} never finished "
                    f"(finished: {self.finished or 'none'}); every rank was stopped. A blocking send or receive "
                    "that no other rank matches waits forever")
        if self.errors:
            rank, error = min(self.errors.items())
            return f"rank {rank} of {self.n} raised {error}"
        tail = self.output.strip().splitlines()[-5:]
        return (f"the MPI job ended before every rank returned (ranks that finished: {self.finished or 'none'})"
                + ("\n  last output: " + "\n  ".join(tail) if tail else ""))

    def check(self) -> "MPIJob":
        """Return the job if every rank finished, else raise (NotImplementedError for a stub)."""
        if self.status == "not_implemented":
            raise NotImplementedError(min(self.errors.items())[1].split(": ", 1)[-1])
        if not self.ok:
            raise MPIJobError(self)
        return self


def mpiexec() -> str:
    """This environment's mpiexec (the mpich wheel puts it next to the interpreter)."""
    for folder in (Path(sys.prefix) / "bin", Path(sys.executable).parent):
        if (folder / "mpiexec").exists():
            return str(folder / "mpiexec")
    found = shutil.which("mpiexec")
    if found:
        return found
    raise FileNotFoundError("no mpiexec in this environment: pip install mpich mpi4py (see `k2c doctor`)")


def _target_name(target) -> str:
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None)
    if module in (None, "__main__") or "<locals>" in getattr(target, "__qualname__", "<locals>"):
        raise ValueError(
            f"{getattr(target, '__name__', target)!r} is defined in a notebook or script's __main__ (or inside "
            "a function), which the MPI ranks cannot import: each rank is a new Python process. Put it in a .py "
            "module next to the notebook and import it from there")
    return f"{module}:{target.__qualname__}"


def run(target, n: int, *args, timeout: float = 60, **kwargs) -> MPIJob:
    """Call ``target(comm, *args, **kwargs)`` on ``n`` ranks; see the module docstring."""
    name = _target_name(target)
    return _launch(["-m", "course.mpi", "call"], n, timeout, {"target": name, "args": args, "kwargs": kwargs})


def run_script(path, n: int, *script_args, timeout: float = 60) -> MPIJob:
    """Run a Python script on ``n`` ranks, as ``mpiexec -n n python path args`` would."""
    return _launch(["-m", "course.mpi", "script"], n, timeout,
                   {"path": str(Path(path).resolve()), "args": [str(a) for a in script_args]})


def _launch(module_args, n, timeout, request) -> MPIJob:
    if n < 1:
        raise ValueError(f"need at least one rank, got n={n}")
    with tempfile.TemporaryDirectory(prefix="k2c-mpi-") as folder:
        # Launcher and ranks run the same code on the caller's behalf, so pickle
        # is fine between them; the grader itself never unpickles (see autograder.codec).
        (Path(folder) / "request.pkl").write_bytes(pickle.dumps(request))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([p or os.getcwd() for p in sys.path if isinstance(p, str)])
        env.setdefault("OMP_NUM_THREADS", "1")  # several ranks share few cores
        env.setdefault("NUMBA_NUM_THREADS", "1")
        log = Path(folder) / "output.txt"
        start = time.monotonic()
        with open(log, "wb") as out:
            proc = subprocess.Popen([mpiexec(), "-launcher", "fork", "-n", str(n), sys.executable, *module_args, folder],
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True)
            try:
                proc.wait(timeout=timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_job(proc)
        job = MPIJob(n, "ok", [None] * n, duration_s=time.monotonic() - start, timeout_s=timeout)
        for rank in range(n):
            reply = Path(folder) / f"rank-{rank}.pkl"
            if reply.exists():
                kind, value = pickle.loads(reply.read_bytes())
                job.finished.append(rank)
                if kind == "ok":
                    job.results[rank] = value
                else:
                    job.errors[rank] = value
                    if kind == "not_implemented" and job.status == "ok":
                        job.status = "not_implemented"
        job.output = log.read_bytes()[-4000:].decode(errors="replace")
    if timed_out:
        job.status = "timeout"
    elif job.errors and job.status == "ok":
        job.status = "raised"
    elif job.status == "ok" and (len(job.finished) < n or proc.returncode != 0):
        job.status = "crashed"
    return job


def _kill_job(proc) -> None:
    """Kill mpiexec and every process it started. Its process group is not enough:
    MPICH's proxies put themselves (and the ranks) in groups of their own."""
    doomed = _descendants(proc.pid)
    for pid in [proc.pid, *doomed]:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    proc.wait()


def _descendants(root: int) -> list[int]:
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


# -- the rank side: python -m course.mpi {call|script} FOLDER ---------------------------

def _rank_main(mode: str, folder: str) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    request = pickle.loads((Path(folder) / "request.pkl").read_bytes())
    reply = Path(folder) / f"rank-{comm.rank}.pkl"
    try:
        if mode == "script":
            import runpy

            sys.argv = [request["path"], *request["args"]]
            runpy.run_path(request["path"], run_name="__main__")
            value = None
        else:
            module, _, qualname = request["target"].rpartition(":")
            if module.endswith(".py"):  # a file by path, e.g. a lab's grading harness
                spec = importlib.util.spec_from_file_location(Path(module).stem, module)
                fn = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(fn)
            else:
                fn = importlib.import_module(module)
            for part in qualname.split("."):
                fn = getattr(fn, part)
            value = fn(comm, *request["args"], **request["kwargs"])
        reply.write_bytes(pickle.dumps(("ok", value)))
    except NotImplementedError as exc:
        reply.write_bytes(pickle.dumps(("not_implemented", f"NotImplementedError: {exc}")))
        _abort_if_others_wait(comm)
    except BaseException as exc:  # noqa: BLE001 - reported, then the job is ended
        frames = traceback.extract_tb(exc.__traceback__)
        # Point at the caller's code, not at this toolkit's (e.g. the audited communicator).
        where = next((f for f in reversed(frames) if not f.filename.startswith(str(Path(__file__).parent))
                      and not f.filename.endswith(".pyx") and "site-packages" not in f.filename), frames[-1])
        reply.write_bytes(pickle.dumps(("raised", f"{type(exc).__name__}: {exc} "
                                        f"(at {Path(where.filename).name}:{where.lineno})")))
        _abort_if_others_wait(comm)
    sys.stdout.flush()


def _abort_if_others_wait(comm) -> None:
    if comm.size > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        comm.Abort(1)


if __name__ == "__main__":
    _rank_main(sys.argv[1], sys.argv[2])
