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

import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from course.jobs import Job, JobError, call_and_reply, kill_tree, load_target, target_name, worker_env
from course.wire import WIRE_FOLDER, WIRE_RANK, WIRE_RANKS, Counter, wait_until_counted

MPIJob, MPIJobError = Job, JobError  # the names this module has always used


def mpiexec() -> str:
    """This environment's mpiexec (the mpich wheel puts it next to the interpreter)."""
    for folder in (Path(sys.prefix) / "bin", Path(sys.executable).parent):
        if (folder / "mpiexec").exists():
            return str(folder / "mpiexec")
    found = shutil.which("mpiexec")
    if found:
        return found
    raise FileNotFoundError("no mpiexec in this environment: pip install mpich mpi4py (see `k2c doctor`)")


# Ranks on one machine talk through shared memory, which no counter sees; for a count of what
# crosses, MPICH sends every message through its TCP network module (libfabric's tcp provider).
TCP_ONLY = {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}


def run(target, n: int, *args, timeout: float = 60, count_wire: bool = False, **kwargs) -> MPIJob:
    """Call ``target(comm, *args, **kwargs)`` on ``n`` ranks; see the module docstring.
    ``count_wire``: every message goes over loopback TCP and ``job.wire`` is what
    crossed between the ranks (``course.wire.Counter``; ranks mark phases with
    ``course.wire.mark``)."""
    name = target_name(target)
    return _launch(["-m", "course.mpi", "call"], n, timeout, {"target": name, "args": args, "kwargs": kwargs},
                   count_wire)


def run_script(path, n: int, *script_args, timeout: float = 60) -> MPIJob:
    """Run a Python script on ``n`` ranks, as ``mpiexec -n n python path args`` would."""
    return _launch(["-m", "course.mpi", "script"], n, timeout,
                   {"path": str(Path(path).resolve()), "args": [str(a) for a in script_args]})


def _launch(module_args, n, timeout, request, count_wire=False) -> MPIJob:
    if n < 1:
        raise ValueError(f"need at least one rank, got n={n}")
    with tempfile.TemporaryDirectory(prefix="k2c-mpi-") as folder:
        # Launcher and ranks run the same code on the caller's behalf, so pickle
        # is fine between them; the grader itself never unpickles (see autograder.sandbox.codec).
        (Path(folder) / "request.pkl").write_bytes(pickle.dumps(request))
        env = worker_env()
        wire = None
        if count_wire:
            env.update(TCP_ONLY, **{WIRE_FOLDER: folder, WIRE_RANKS: str(n)})
            wire = Counter(Path(folder), n)  # before any rank starts
        log = Path(folder) / "output.txt"
        start = time.monotonic()
        with open(log, "wb") as out:
            proc = subprocess.Popen([mpiexec(), "-launcher", "fork", "-n", str(n), sys.executable, *module_args, folder],
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True)
            try:
                timed_out = _wait(proc, start + timeout, wire)
            finally:
                kill_tree(proc)
        job = Job(n, "ok", [None] * n, duration_s=time.monotonic() - start, timeout_s=timeout, kind="MPI")
        job.read_replies(Path(folder))
        job.output = log.read_bytes()[-4000:].decode(errors="replace")
        job.wire = wire.as_dict() if wire else None
    return job.settle(timed_out, clean_exit=proc.returncode == 0)


def _wait(proc, deadline, wire) -> bool:
    """Wait for mpiexec (sampling the count, if any, as it runs); True when time ran out."""
    if wire is None:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            return False
        except subprocess.TimeoutExpired:
            return True
    while proc.poll() is None:
        if time.monotonic() > deadline:
            return True
        wire.sample()
        time.sleep(0.003)
    return False


# -- the rank side: python -m course.mpi {call|script} FOLDER ---------------------------

def _rank_main(mode: str, folder: str) -> None:
    from course import refuse
    from mpi4py import MPI

    refuse.install_from_env()
    comm = MPI.COMM_WORLD
    if WIRE_FOLDER in os.environ:
        os.environ[WIRE_RANK] = str(comm.rank)  # for course.wire.mark
    request = pickle.loads((Path(folder) / "request.pkl").read_bytes())
    reply = Path(folder) / f"rank-{comm.rank}.pkl"
    if mode == "script":
        import runpy

        sys.argv = [request["path"], *request["args"]]
        ok = call_and_reply(lambda: runpy.run_path(request["path"], run_name="__main__") and None, reply)
    else:
        ok = call_and_reply(lambda: load_target(request["target"])(comm, *request["args"], **request["kwargs"]), reply)
    if not ok:
        _abort_if_others_wait(comm)
    if WIRE_FOLDER in os.environ:
        wait_until_counted(folder)  # the launcher's last count, before MPI closes the connections
    sys.stdout.flush()


def _abort_if_others_wait(comm) -> None:
    if comm.size > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        comm.Abort(1)


if __name__ == "__main__":
    _rank_main(sys.argv[1], sys.argv[2])
