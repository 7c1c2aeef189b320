"""Run a function on N torch.distributed processes — from a notebook, a lab or the grader.

    from course import dist
    job = dist.run("ddp:train", 4, steps=5, timeout=60)   # or a function object
    job.results        # what each process returned, by rank
    job.check()        # raise a readable error unless every rank finished

``target`` is a function, ``"module:function"`` or ``"path/to/file.py:function"``.
``run(target, n, *args)`` starts one fresh Python process (this interpreter,
this environment) that imports torch and then forks the ``n`` ranks: importing
torch takes seconds, so a job pays it once, not once per rank. Where this
process has imported torch already and runs no other thread (the grader's
sandbox preloads it), it forks that process instead, and a job pays nothing.
A notebook's kernel cannot fork (it runs threads), so its first job starts a
process that imports torch and stays (``_Launchpad``); that one forks every
later job's ranks, and a notebook pays the import once.

Rank 0 opens a rendezvous store on a free loopback port
(the operating system picks it, so parallel jobs never collide) and tells the
others where it is; each process then joins the default process group — gloo
on the CPU, NCCL when every rank can have a GPU of its own — and calls
``target(*args, **kwargs)``. The target uses ``torch.distributed`` as it would
under ``torchrun``: ``dist.get_rank()``, ``dist.all_reduce(...)``, and
``device()`` for where its tensors go. Lab code written this way runs
unchanged on a multi-GPU node: ``torchrun --nproc-per-node 8 script.py`` with
``init()`` at the top of the script.

A job never outlives its timeout, and one rank's error ends it: the other ranks
would otherwise wait in their next collective until gloo's own timeout (half
an hour). Every process of the job is killed either way, and the result says
which ranks had finished. With ``idle_timeout=s`` a job is also stopped, as
timed out, once none of its processes has used the CPU for ``s`` seconds:
gloo's waits sleep rather than spin, so that is how a deadlock looks, and it
shows long before a timeout sized for a busy machine (the grader's harnesses
use ``IDLE_TIMEOUT_S``; a target that sleeps on purpose must not).

The target must be importable by the worker processes — a function in a
``.py`` module, not one defined in a notebook: the workers come from a new
interpreter that cannot see the notebook's ``__main__`` (this is also why
``torch.multiprocessing.spawn`` fails there). The caller's working folder and
``sys.path`` are passed on, so a module next to the notebook works.
"""
from __future__ import annotations

import datetime
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from course import refuse
from course.jobs import (Job, JobError, alive, call_and_reply, descendants, kill_tree, load_target, target_name,
                         worker_env)
from course.wire import WIRE_FOLDER, WIRE_RANK, WIRE_RANKS, Counter, wait_until_counted

DistJob, DistJobError = Job, JobError
HOST = "127.0.0.1"
# A deadlocked job's ranks use a clock tick (10 ms) or so every few seconds; a working
# one uses at least one rank's share of a core, even with its peers oversubscribed.
IDLE_TIMEOUT_S = 5
IDLE_CPU_S = 0.1  # less CPU than this over the last idle_timeout seconds, summed over the job, is idle


def run(target, n: int, *args, timeout: float = 60, backend: str = "auto", idle_timeout: float | None = None,
        count_wire: bool = False, **kwargs) -> Job:
    """Call ``target(*args, **kwargs)`` on ``n`` processes; see the module docstring.
    ``count_wire``: ``job.wire`` is what crossed between the ranks (``course.wire.Counter``)."""
    if n < 1:
        raise ValueError(f"need at least one process, got n={n}")
    request = {"target": target_name(target), "args": args, "kwargs": kwargs, "backend": backend,
               "timeout": timeout, "count_wire": count_wire}
    with tempfile.TemporaryDirectory(prefix="k2c-dist-") as folder:
        # Launcher and workers run the same code on the caller's behalf, so pickle
        # is fine between them; the grader itself never unpickles (see autograder.sandbox.codec).
        (Path(folder) / "request.pkl").write_bytes(pickle.dumps(request))
        log = Path(folder) / "output.txt"
        start = time.monotonic()
        env = worker_env()
        env.update(WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n), MASTER_ADDR=HOST)
        # Its first count, before any rank starts, is what was there already: not the job's.
        wire = Counter(Path(folder), n) if count_wire else None
        with open(log, "wb") as out:
            # A session of its own, which the ranks share: killing it (and what
            # they started) cannot touch the caller.
            if _can_fork_here():
                forker = _Forked(folder, n, env, out)
            elif _in_notebook():
                forker = _Launchpad.for_env(env).launch(folder, n, env, log)
            else:
                forker = subprocess.Popen([sys.executable, "-m", "course.dist", folder, str(n)], env=env,
                                          stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True)
            try:
                stopped, codes = _wait(forker, Path(folder), n, start + timeout, idle_timeout, wire)
            finally:
                # Freeze every rank first: one that sees a peer die would report that as its own error.
                try:
                    os.killpg(forker.pid, signal.SIGSTOP)
                except OSError:
                    pass
                kill_tree(forker)
        job = Job(n, "ok", [None] * n, duration_s=time.monotonic() - start, timeout_s=timeout, kind="torch",
                  idle_s=idle_timeout if stopped == "idle" else 0.0)
        job.read_replies(Path(folder))
        # Exit codes as the launcher saw them, before it killed the job: a negative one is a signal.
        job.killed = {rank: _signal_name(-code) for rank, code in enumerate(codes)
                      if code is not None and code < 0 and rank not in job.finished}
        job.output = log.read_bytes()[-4000:].decode(errors="replace")
        job.wire = wire.as_dict() if wire else None
    return job.settle(stopped is not None, clean_exit=all(code == 0 for code in codes))


def _can_fork_here() -> bool:
    """Whether the ranks can be forked from this process instead of a new one:
    it has imported torch already (the grader's sandbox does, for the labs that
    use it), runs no other Python thread that a fork would cut off (a notebook's
    kernel does), and keeps to one OpenMP thread (``OMP_NUM_THREADS=1``, as the
    sandbox sets it), so no OpenMP thread pool, which does not survive a fork,
    can exist."""
    import threading

    return ("torch.distributed" in sys.modules and threading.active_count() == 1
            and os.environ.get("OMP_NUM_THREADS") == "1")


class _Forked:
    """The forker as a fork of this process (see ``_can_fork_here``), with the
    little of ``subprocess.Popen`` that ``run`` uses."""

    def __init__(self, folder: str, n: int, env: dict, out):
        sys.stdout.flush()
        sys.stderr.flush()
        self.returncode = None
        self.pid = os.fork()
        if self.pid == 0:
            try:
                os.setsid()
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                os.dup2(out.fileno(), 1)
                os.dup2(out.fileno(), 2)
                os.environ.update({k: env[k] for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")})
                _forker_main(folder, n, fresh=False)
            finally:
                os._exit(1)

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self):
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode


def _in_notebook() -> bool:
    """Whether this is a Jupyter kernel, which runs several jobs and cannot fork (its threads).
    Only the kernel's own shell says so: ipykernel is imported elsewhere too (pytest's nbval plugin)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return type(shell).__name__ == "ZMQInteractiveShell"


class _Launchpad:
    """For a notebook: one process that has imported torch (``python -m course.dist
    --launchpad``) and forks each job's forker, so a notebook pays the import once,
    not once per job. It reads one job per line on stdin and ends when the kernel
    closes that pipe, by exiting or dying. A job's forker gets the job's own
    environment, working folder and ``sys.path``."""

    _current: "_Launchpad | None" = None

    @classmethod
    def for_env(cls, env: dict) -> "_Launchpad":
        key = (sys.executable, env.get(refuse.ENV), env.get("OMP_NUM_THREADS"))
        current = cls._current
        if current is None or current.key != key or current.proc.poll() is not None:
            if current is not None:
                current.close()
            cls._current = cls(key, env)
        return cls._current

    def __init__(self, key, env: dict):
        self.key, self.lock = key, threading.Lock()
        self.proc = subprocess.Popen([sys.executable, "-m", "course.dist", "--launchpad"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     start_new_session=True)

    def launch(self, folder: str, n: int, env: dict, log: Path) -> "_Launched":
        request = {"folder": folder, "n": n, "env": env, "cwd": os.getcwd(), "log": str(log)}
        with self.lock:  # jobs started from several threads take turns at the pipe
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            reply = self.proc.stdout.readline()  # the forker's pid, once torch is loaded (the first job waits)
        if not reply.strip().isdigit():
            raise RuntimeError(f"course.dist's launchpad ended before it started the job (exit {self.proc.poll()})")
        return _Launched(int(reply))

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


class _Launched:
    """A forker the launchpad started (its child, not ours), with the little of
    ``subprocess.Popen`` that ``run`` uses; its exit code is not ours to read,
    and ``run`` reads the ranks' own."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode = None

    def poll(self):
        if self.returncode is None and not alive(self.pid):
            self.returncode = 0
        return self.returncode

    def wait(self):
        while self.poll() is None:
            time.sleep(0.01)
        return self.returncode


def _launchpad_main() -> None:
    """``python -m course.dist --launchpad``: import torch, then fork a forker per line of stdin."""
    refuse.install_from_env()  # before torch, as in a job's own interpreter
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch._dynamo  # noqa: F401

    def reap(*_):
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass

    signal.signal(signal.SIGCHLD, reap)
    base_path = list(sys.path)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.setsid()
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                log = os.open(request["log"], os.O_WRONLY | os.O_APPEND)
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.environ.clear()
                os.environ.update(request["env"])
                os.chdir(request["cwd"])
                wanted = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
                sys.path[:] = [request["cwd"], *wanted, *(p for p in base_path if p not in wanted)]
                _forker_main(request["folder"], request["n"], fresh=False)
            finally:
                os._exit(1)
        sys.stdout.write(f"{pid}\n")
        sys.stdout.flush()
    os._exit(0)  # the kernel has gone: no interpreter teardown, which torch makes slow


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _exit_codes(folder: Path, n: int) -> list:
    """Each rank's exit code as the forker wrote it (negative: the signal that
    ended it), or None while it runs."""
    codes = [None] * n
    for rank in range(n):
        try:
            codes[rank] = int((folder / f"exit-{rank}").read_text())
        except (OSError, ValueError):
            pass
    return codes


def mark(name: str, timeout: float = 30) -> None:
    """On every rank of a ``run(..., count_wire=True)`` job, together: the launcher
    notes the bytes that have crossed by now under ``name`` (``course.wire.mark``)."""
    from course import wire

    wire.mark(name, timeout=timeout)




def _wait(forker, folder: Path, n: int, deadline, idle_timeout=None, wire=None) -> tuple[str | None, list]:
    """Wait until every rank exits, one fails, the forker dies, the deadline
    passes ("timeout") or the job idles for ``idle_timeout`` s ("idle"); return
    (None or why it was stopped, each rank's exit code or None) at that moment."""
    codes = [None] * n
    samples = []  # (time, CPU ticks per process of the job), every half second
    while time.monotonic() < deadline:
        if wire is not None:
            wire.sample()
        gone = forker.poll() is not None
        codes = _exit_codes(folder, n)
        if gone or all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
            return None, codes
        if idle_timeout and _idled(samples, forker.pid, idle_timeout):
            return "idle", codes
        time.sleep(0.003 if wire is not None else 0.02)  # a mark waits for the next sample
    return "timeout", codes


def _idled(samples: list, root: int, seconds: float) -> bool:
    """Whether the processes of the job under ``root`` used less than ``IDLE_CPU_S``
    of CPU in all over the last ``seconds`` (Linux /proc; elsewhere never)."""
    now = time.monotonic()
    if samples and now - samples[-1][0] < 0.5:
        return False
    ticks = {}
    for pid in [root, *descendants(root)]:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks[pid] = int(fields[11]) + int(fields[12])  # utime + stime, every thread's
        except (OSError, IndexError, ValueError):
            pass
    samples.append((now, ticks))
    while len(samples) > 1 and now - samples[1][0] >= seconds:
        samples.pop(0)  # keep the newest sample at least ``seconds`` old
    then, before = samples[0]
    if now - then < seconds or not ticks:
        return False
    # A process that is new (or has a new pid) since then counts as work; one that exited does not.
    used = sum(count - before.get(pid, -10**9) for pid, count in ticks.items())
    return used < IDLE_CPU_S * os.sysconf("SC_CLK_TCK")


def backend_for(n: int, backend: str = "auto") -> str:
    """NCCL when each of ``n`` local ranks can have a GPU of its own, else gloo."""
    if backend != "auto":
        return backend
    import torch

    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= n else "gloo"


def device():
    """Where this rank's tensors go: its own GPU under NCCL, else the CPU."""
    import torch
    import torch.distributed as tdist

    if tdist.is_initialized() and tdist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", tdist.get_rank())))
    return torch.device("cpu")


def init(backend: str = "auto", timeout: float = 600):
    """Join the default process group from torchrun's environment variables
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); a no-op when already joined.
    For scripts run with ``torchrun``, which end with
    ``torch.distributed.destroy_process_group()`` (without it gloo may abort the
    process as it exits); ``run`` does all this for its workers."""
    import torch
    import torch.distributed as tdist

    if not tdist.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", 1))
        chosen = backend_for(int(os.environ.get("LOCAL_WORLD_SIZE", world)), backend)
        if chosen == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        tdist.init_process_group(chosen, timeout=datetime.timedelta(seconds=timeout))
    return tdist.group.WORLD


# -- the ranks' side: python -m course.dist FOLDER N -----------------------------------

def _forker_main(folder: str, n: int, fresh: bool = True) -> None:
    """Import torch once (``fresh``: in a new interpreter), then fork the ``n``
    ranks and record how each exits. No thread runs yet when it forks (the
    launcher asks for one OpenMP thread, and nothing has computed), which is
    what makes forking safe."""
    from course import refuse

    if fresh:
        refuse.install_from_env()  # before torch: a refused object is replaced as its module loads
    import torch  # noqa: F401 - loaded once here, inherited by every rank
    import torch.distributed  # noqa: F401
    # The first optimizer (torch.optim) or compiled function imports torch._dynamo,
    # 1-2 s of CPU: once here, not once in every rank that trains.
    import torch._dynamo  # noqa: F401

    sys.stdout.flush()
    sys.stderr.flush()
    ranks = {}
    for rank in range(n):
        pid = os.fork()
        if pid == 0:
            try:
                _worker_main(folder, rank, n)
            finally:
                os._exit(1)
        ranks[pid] = rank
    while ranks:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        if pid in ranks:
            code = Path(folder) / f"exit-{ranks.pop(pid)}"
            code.with_suffix(".tmp").write_text(str(os.waitstatus_to_exitcode(status)))
            code.with_suffix(".tmp").rename(code)
    os._exit(0)


def _worker_main(folder: str, rank: int, n: int) -> None:
    import torch
    import torch.distributed as tdist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    request = pickle.loads((Path(folder) / "request.pkl").read_bytes())
    if request.get("count_wire"):
        os.environ.update({WIRE_FOLDER: folder, WIRE_RANK: str(rank), WIRE_RANKS: str(n)})  # for mark()
    if "numpy.random" in sys.modules:  # as unrelated as in processes of their own
        sys.modules["numpy.random"].seed()
    # gloo's own timeout comes after the launcher's, which then reports the hang as such.
    timeout = datetime.timedelta(seconds=request["timeout"] + 60)
    torch.set_num_threads(1)  # several workers share few cores
    port_file = Path(folder) / "port"
    if rank == 0:
        store = tdist.TCPStore(HOST, 0, n, True, timeout=timeout, wait_for_workers=False)
        port_file.with_suffix(".tmp").write_text(str(store.port))
        port_file.with_suffix(".tmp").rename(port_file)  # appears whole or not at all
    else:
        while not port_file.exists():
            time.sleep(0.01)
        store = tdist.TCPStore(HOST, int(port_file.read_text()), n, False, timeout=timeout)
    os.environ["MASTER_PORT"] = str(store.port)
    backend = backend_for(n, request["backend"])
    if backend == "nccl":
        torch.cuda.set_device(rank)
    tdist.init_process_group(backend, store=store, rank=rank, world_size=n, timeout=timeout)
    reply = Path(folder) / f"rank-{rank}.pkl"
    ok = call_and_reply(lambda: load_target(request["target"])(*request["args"], **request["kwargs"]), reply)
    sys.stdout.flush()
    sys.stderr.flush()
    if not ok:
        os._exit(1)  # the launcher sees it and stops the others
    if request.get("count_wire"):
        wait_until_counted(folder)  # the launcher's last count, before any connection closes
    # Leave together (a message still in flight to a slower rank is not cut off),
    # and rank 0, which hosts the store, last.
    _store_barrier(store, "done", n)
    if rank == 0:
        _store_barrier(store, "left", n)
    else:
        store.add("left", 1)
    os._exit(0)  # no interpreter teardown: a worker's stray threads cannot keep it alive


def _store_barrier(store, key, n):
    store.add(key, 1)
    while store.add(key, 0) < n:
        time.sleep(0.005)


if __name__ == "__main__":
    if sys.argv[1:] == ["--launchpad"]:
        _launchpad_main()
    else:
        _forker_main(sys.argv[1], int(sys.argv[2]))
