"""A job of N ranks that share nothing but the network, and what its launcher measures.

A lab of several processes (MPI ranks, torch workers) is graded as a *rank job*:
the grader draws each rank's inputs, writes rank r's to a file only rank r may
read (``inputs[r]``), and asks a call in the sandbox to ``launch`` the job. The
launcher is course code only: it imports nothing of the student's, holds no
rank's inputs and knows no answer. It starts the ranks (torch: forked from
this process, which has torch loaded; MPI: ``mpiexec``), and each rank, before
anything of the student's loads, is kept apart from its peers
(``autograder.sandbox.rank_isolation``: its own user, ``/tmp`` and ``/dev/shm``,
no unix sockets, no child processes), reads its own inputs, and calls the
harness's rank function (``target``: ``fn(inputs)`` under torch, ``fn(comm,
inputs)`` under MPI), which calls the student's code.

What comes back is plain data, measured from outside the ranks or carried
undecoded: each rank's ``emit``-ted values as codec bytes (the grader decodes and
compares them with its own answer), its error if it raised, its peak resident
memory above what it held when it had read its inputs (``VmHWM``, read by the
launcher from ``/proc``), at each ``mark`` what each rank held (``VmRSS``) and its
peak since the last mark that started the peaks afresh (``fresh_peak``: the
launcher writes the rank's ``clear_refs``), and with ``count_wire`` the bytes that
crossed between the ranks by each ``mark``, in all and per rank (the kernel's TCP
counters, ``course.wire``, attributed by each socket's owner, the rank's user),
and the CPU seconds each rank had used by each of its marks (the kernel's count of
its threads' user and system time, ``/proc/PID/stat``), which nothing a rank does can lower,
and the launcher's clock at each mark.

Each rank talks to the launcher over one connected unix socket, in frames of
one kind byte, a 4-byte length and a body; the launcher reads the kind and the
length, and forwards the bodies of ``EMIT`` frames as they are.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback

from autograder.sandbox import codec, rank_isolation

# rank -> launcher
HELLO, READY, EMIT, MARK, PORT, DONE, ERROR = b"H", b"R", b"E", b"M", b"P", b"D", b"X"
# launcher -> rank
GO, PEER_PORT, COUNTED = b"g", b"p", b"c"
_FRAME = struct.Struct("<cI")
EMIT_LIMIT = 2**30  # bytes of emitted values kept per job; past it the job ends as crashed
AUDIT_LIMIT = 2**18  # bytes of a rank's audit records kept
SAMPLE_S = 0.003  # the launcher's loop: counters and memory sampled this often while a job runs
IDLE_CPU_S = 0.1  # a job whose processes used less CPU than this over idle_timeout seconds is stopped as hung
HOST = "127.0.0.1"


# --- the frames --------------------------------------------------------------------------

def send(sock: socket.socket, kind: bytes, body: bytes = b"") -> None:
    sock.sendall(_FRAME.pack(kind, len(body)) + body)


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        got = sock.recv(n - len(data))
        if not got:
            raise ConnectionError("the launcher is gone")
        data += got
    return bytes(data)


def receive(sock: socket.socket) -> tuple[bytes, bytes]:
    kind, length = _FRAME.unpack(_read_exactly(sock, _FRAME.size))
    return kind, _read_exactly(sock, length)


class _Reader:
    """The launcher's side of one rank's socket: frames as they arrive, without blocking."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buffer, self.closed = sock, bytearray(), False
        sock.setblocking(False)

    def frames(self) -> list[tuple[bytes, bytes]]:
        try:
            data = self.sock.recv(1 << 20)
            if not data:
                self.closed = True
            self.buffer += data
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self.closed = True
        found = []
        while len(self.buffer) >= _FRAME.size:
            kind, length = _FRAME.unpack_from(self.buffer)
            if len(self.buffer) < _FRAME.size + length:
                break
            found.append((kind, bytes(self.buffer[_FRAME.size:_FRAME.size + length])))
            del self.buffer[:_FRAME.size + length]
        return found

    def send(self, kind: bytes, body: bytes = b"") -> None:
        self.sock.setblocking(True)
        try:
            send(self.sock, kind, body)
        except OSError:
            self.closed = True
        finally:
            self.sock.setblocking(False)


# --- the rank's side -----------------------------------------------------------------------

_channel: socket.socket | None = None
_audit_fd: int | None = None  # where this rank's audit hook writes (a pipe or socket to the launcher)
_job: dict = {}


def job() -> dict:
    """The job this rank runs in: its kind, its size, and where each rank's inputs lie
    (no secret: every rank's are readable by that rank alone)."""
    return dict(_job)


def emit(value) -> None:
    """Send ``value`` (plain data: numbers, strings, lists, tuples, dicts, NumPy arrays) to
    the grader, in order; a harness's rank function emits one record per case."""
    send(_channel, EMIT, codec.encode(value))


def mark(name: str, ranks: int | None = None, timeout: float = 60, fresh_peak: bool = False) -> None:
    """Made by ranks 0 .. ``ranks`` - 1 (all by default), each once, with the same ``name``:
    the launcher notes the bytes that have crossed, and each rank's resident memory and
    peak memory and the CPU seconds it has used and the time by then (the launcher's
    clock, when the last of them made the mark), and each rank waits until it has. With ``fresh_peak`` the
    launcher then starts each rank's high-water mark afresh at what it holds now, so that
    the next mark's peak is that phase's own, not an earlier phase's."""
    send(_channel, MARK, json.dumps({"name": name, "ranks": ranks, "fresh_peak": fresh_peak}).encode())
    _channel.settimeout(timeout)
    try:
        kind, _ = receive(_channel)
    finally:
        _channel.settimeout(None)
    if kind != GO:
        raise RuntimeError(f"mark {name!r}: the launcher answered {kind!r}")


class CannotIsolate(RuntimeError):
    """A rank could not be kept apart: the machine's fault, never the student's."""


def _fail(error: BaseException, submission: str) -> None:
    if isinstance(error, CannotIsolate):
        report = {"status": "infrastructure", "message": str(error)}
    elif isinstance(error, NotImplementedError):
        report = {"status": "not_implemented", "message": str(error)}
    else:
        frames = traceback.extract_tb(error.__traceback__)
        where = [f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}: {(f.line or '').strip()}"
                 for f in frames if f.filename.startswith(submission)][-3:]
        report = {"status": "raised", "type": type(error).__name__, "message": str(error)[:2000], "where": where}
    try:
        send(_channel, ERROR, json.dumps(report).encode())
    except OSError:
        pass


def _load(target: str):
    import importlib.util

    path, _, name = target.rpartition(":")
    spec = importlib.util.spec_from_file_location("k2c_harness", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["k2c_harness"] = module
    spec.loader.exec_module(module)
    return getattr(module, name)


def _rank_body(rank: int, n: int, job: dict, comm_of=None) -> None:
    """Everything a rank does once it is kept apart: read its inputs, join the group, call
    the target, report; never returns."""
    code = 1
    _job.update(job)
    try:
        with open(job["inputs"][rank], "rb") as f:
            inputs = codec.decode(f.read())
        send(_channel, READY, str(os.getpid()).encode())
        if _audit_fd is not None:  # the flags for the instructor, as in a call (autograder.sandbox.audit)
            from autograder.sandbox import audit

            allowed, denied = job["reads"]
            audit.install(_audit_fd, job["submission"], [*allowed, os.path.dirname(job["target"].rpartition(":")[0])],
                          denied, _rank_body.__code__)
        sys.path.insert(0, job["submission"])
        if job["kind"] == "torch":
            store = _join_torch_group(rank, n, job)
            value = _load(job["target"])(inputs)
        else:
            value = _load(job["target"])(comm_of(), inputs)
        if _audit_fd is not None:
            from autograder.sandbox import audit

            audit.end()  # the last record: the rank's own code ran past the student's
        if value is not None:
            emit(value)
        sys.stdout.flush()
        sys.stderr.flush()
        send(_channel, DONE)
        kind, _ = receive(_channel)  # COUNTED: the launcher's last count, before any connection closes
        if job["kind"] == "torch":
            _store_barrier(store, "done", n)  # leave together: nothing in flight to a slower rank is cut off
            if rank == 0:
                _store_barrier(store, "left", n)
            else:
                store.add("left", 1)
        code = 0
    except BaseException as exc:  # noqa: BLE001 - reported, then the job ends
        _fail(exc, job["submission"])
        sys.stdout.flush()
        sys.stderr.flush()
        if job["kind"] == "mpi" and comm_of is not None and n > 1:
            comm_of().Abort(1)
    os._exit(code)


def _join_torch_group(rank: int, n: int, job: dict):
    import datetime

    import torch
    import torch.distributed as tdist

    from course.dist import backend_for

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                      MASTER_ADDR=HOST)
    if "numpy.random" in sys.modules:  # as unrelated as in processes of their own
        sys.modules["numpy.random"].seed()
    torch.set_num_threads(1)  # several ranks share few cores
    timeout = datetime.timedelta(seconds=job["timeout"] + 60)  # gloo's own timeout after the launcher's
    if rank == 0:
        store = tdist.TCPStore(HOST, 0, n, True, timeout=timeout, wait_for_workers=False)
        send(_channel, PORT, str(store.port).encode())
    else:
        kind, body = receive(_channel)
        if kind != PEER_PORT:
            raise RuntimeError(f"expected the rendezvous port from the launcher, got {kind!r}")
        store = tdist.TCPStore(HOST, int(body), n, False, timeout=timeout)
    os.environ["MASTER_PORT"] = str(store.port)
    backend = backend_for(n, job.get("backend", "auto"))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    tdist.init_process_group(backend, store=store, rank=rank, world_size=n, timeout=timeout)
    return store


def _store_barrier(store, key: str, n: int) -> None:
    store.add(key, 1)
    while store.add(key, 0) < n:
        time.sleep(0.005)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
LARGE_BYTES = 1 << 20


def _honest_peaks() -> None:
    """Every allocation of 1 MiB or more straight from the kernel and back to it when freed
    (``mallopt``): the peak the launcher reads is then what the rank held at once, not what
    glibc kept of freed blocks (its threshold otherwise grows to 32 MiB as large blocks are
    freed, and a loop of 16 MiB temporaries reads as several times its real peak)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(M_MMAP_THRESHOLD, LARGE_BYTES)
        libc.mallopt(M_TRIM_THRESHOLD, LARGE_BYTES)
    except (OSError, AttributeError):
        pass  # not glibc: peaks may read high, never low


def _enter(rank: int, job: dict) -> None:
    """Before anything of the student's: kept apart (where the launcher may), the rank's
    own scratch folder as HOME and TMPDIR, no environment naming the launcher's; honest
    peaks unless the job times its ranks instead (``exact_peaks`` false: every large
    temporary then costs its page faults again, which doubled lab 13's larger step times)."""
    if job.get("exact_peaks", True):
        _honest_peaks()
    rank_isolation.enter(rank, job["keep"])
    os.environ.update(HOME="/tmp", TMPDIR="/tmp", USER=f"rank{rank}", LOGNAME=f"rank{rank}")
    import tempfile

    tempfile.tempdir = None


def torch_rank_main(rank: int, n: int, job: dict, sock: socket.socket, audit_fd: int) -> None:
    """A forked torch rank: keep only its socket and its audit pipe, be kept apart, run.
    Never returns."""
    global _channel, _audit_fd
    try:
        keep = (sock.fileno(), audit_fd)
        _audit_fd = audit_fd
        for fd in range(3, _max_fd()):
            if fd not in keep:
                try:
                    os.close(fd)
                except OSError:
                    pass
        _channel = sock
        _enter(rank, job)
    except BaseException as exc:  # noqa: BLE001 - a rank that cannot be kept apart must not run
        _channel = sock
        _fail(CannotIsolate(f"rank {rank} could not be kept apart from its peers: {exc}"), job["submission"])
        os._exit(1)
    _rank_body(rank, n, job)


def mpi_rank_main(address: str, job_json: str) -> None:
    """``python -I -c BOOT``, started by ``mpiexec`` as the launcher's user: say hello, be
    kept apart, then import mpi4py (MPI_Init) and run. Never returns."""
    global _channel
    job = json.loads(job_json)
    rank, n = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
    global _audit_fd
    _channel = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    _channel.connect("\0" + address)  # before the seccomp filter, which refuses unix sockets
    send(_channel, HELLO, json.dumps({"rank": rank}).encode())
    audit = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # the audit hook's records, a stream of their own
    audit.connect("\0" + address)
    send(audit, HELLO, json.dumps({"rank": rank, "audit": True}).encode())
    _audit_fd = audit.detach()
    try:
        _enter(rank, job)
    except BaseException as exc:  # noqa: BLE001
        _fail(CannotIsolate(f"rank {rank} could not be kept apart from its peers: {exc}"), job["submission"])
        os._exit(1)

    def comm():
        from mpi4py import MPI

        return MPI.COMM_WORLD
    _rank_body(rank, n, job, comm)


def _max_fd() -> int:
    try:
        return max(int(fd) for fd in os.listdir("/proc/self/fd")) + 1
    except (OSError, ValueError):
        return 1024


# --- the launcher --------------------------------------------------------------------------

MPI_BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "from autograder.sandbox.ranks import mpi_rank_main; mpi_rank_main(sys.argv[2], sys.argv[3])")


class _Rank:
    def __init__(self, rank: int):
        self.rank, self.pid, self.reader = rank, None, None
        self.frames: list[bytes] = []  # EMIT bodies, as they came
        self.audit_fd: int | None = None  # the rank's audit records (autograder.sandbox.audit), read raw
        self.audit = bytearray()
        self.error: dict | None = None
        self.ready = self.done = self.told = False
        # bytes: VmRSS when ready; VmHWM over the whole job; the most VmRSS sampled since the peak last started afresh
        self.baseline = self.peak = self.sampled = 0
        self.exit = None
        self.tampered = False  # its VmHWM fell below what the launcher had seen it hold: reset from inside

    def read_audit(self) -> None:
        while self.audit_fd is not None and len(self.audit) < AUDIT_LIMIT:
            try:
                data = os.read(self.audit_fd, 1 << 16)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                os.close(self.audit_fd)
                self.audit_fd = None
                return
            self.audit += data

    def read_memory(self) -> list[int]:
        """[what it holds now (VmRSS), its peak since its high-water mark last started afresh
        (VmHWM, which only the launcher resets: a sample above it means it was reset from inside)]."""
        held, high = _status_bytes(self.pid, "VmRSS", "VmHWM")
        self.tampered |= self.sampled > high + 2**20
        peak = max(high, self.sampled, held)
        self.peak = max(self.peak, peak)
        return [held, peak]

    def restart_peak(self) -> bool:
        """Start its high-water mark afresh at what it holds now (``clear_refs``, which the rank
        itself cannot write: ``rank_isolation`` masks it); False where this launcher may not."""
        try:
            with open(f"/proc/{self.pid}/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            return False
        self.sampled = 0
        return True


def _cpu_seconds(pid: int) -> float | None:
    """User and system CPU seconds the process's threads have used (``/proc/PID/stat``,
    fields 14 and 15, in clock ticks); None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _status_bytes(pid: int, *fields: str):
    """Each field of ``/proc/PID/status`` in bytes (0 where it cannot be read): one value for
    one field, else a list."""
    found = dict.fromkeys(fields, 0)
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name = line.split(":", 1)[0]
                if name in found:
                    found[name] = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    values = [found[field] for field in fields]
    return values[0] if len(values) == 1 else values


def launch(job: dict) -> dict:
    """Run ``job`` (see the module docstring: ``kind`` torch or mpi, ``target``
    "harness.py:function", ``n``, ``inputs`` (a file per rank), ``submission``,
    ``timeout``, ``idle_timeout``, ``count_wire``, ``env``, ``exact_peaks``); return what came back and
    what was measured, as plain data."""
    from course.wire import Connections, available as wire_available

    from autograder.sandbox import isolation

    n = job["n"]
    plan = rank_isolation.plan()
    # What the ranks read besides the system: shown again where a rank's private /tmp would cover it.
    keep = [job["submission"], os.path.dirname(job["target"].rpartition(":")[0]), os.path.dirname(job["inputs"][0]),
            *isolation.needed_paths()]
    job = dict(job, keep=keep)
    ranks = [_Rank(r) for r in range(n)]
    wire_why = wire_available() if job.get("count_wire") else "not counted"
    seen = Connections() if not wire_why else None
    if seen is not None:
        seen.sample()  # what is there before the job is not the job's
    os.environ.update(job.get("env", {}))
    start = time.monotonic()
    mpiexec_proc, listener = None, None
    if job["kind"] == "torch":
        for rank in ranks:
            ours, theirs = socket.socketpair()
            audit_read, audit_write = os.pipe()
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                ours.close()
                os.close(audit_read)
                torch_rank_main(rank.rank, n, job, theirs, audit_write)
            theirs.close()
            os.close(audit_write)
            os.set_blocking(audit_read, False)
            rank.pid, rank.reader, rank.audit_fd = pid, _Reader(ours), audit_read
    else:
        listener, mpiexec_proc = _start_mpi(job)
    marks, waiting = [], {}
    peer_port, stopped = None, None
    last_sample, idle = 0.0, []
    while True:
        now = time.monotonic()
        if listener is not None:
            _accept(listener, ranks)
        for rank in ranks:
            rank.read_audit()
            if rank.reader is None:
                continue
            for kind, body in rank.reader.frames():
                if kind == READY:
                    rank.ready = True
                    rank.pid = rank.pid or int(body)
                    rank.baseline = _status_bytes(rank.pid, "VmRSS")
                elif kind == EMIT:
                    rank.frames.append(body)
                elif kind == PORT and rank.rank == 0:
                    peer_port = body
                elif kind == MARK:
                    wanted = json.loads(body)
                    group = waiting.setdefault(wanted["name"], set())
                    group.add(rank.rank)
                    if len(group) >= (wanted["ranks"] or n):
                        if seen is not None:
                            seen.sample()
                        memory, fresh = [None] * n, bool(wanted.get("fresh_peak"))
                        for member in sorted(group):
                            memory[member] = ranks[member].read_memory()
                            if wanted.get("fresh_peak"):
                                fresh = ranks[member].restart_peak() and fresh
                        cpu = [_cpu_seconds(ranks[r].pid) if r in group else None for r in range(n)]
                        # the launcher's clock when the last rank made it: a step timed between
                        # marks is timed from outside the ranks
                        marks.append([wanted["name"], *_crossed(seen, n), memory, fresh, cpu, time.monotonic() - start])
                        for member in sorted(group):
                            ranks[member].reader.send(GO)
                        del waiting[wanted["name"]]
                elif kind == DONE:
                    rank.read_memory()
                    rank.done = True
                elif kind == ERROR:
                    rank.error = json.loads(body)
        if peer_port is not None:  # rank 0's rendezvous store, to each other rank once it is connected
            for other in ranks[1:]:
                if other.reader is not None and not other.told:
                    other.reader.send(PEER_PORT, peer_port)
                    other.told = True
        if all(r.done for r in ranks):
            if seen is not None:
                seen.sample()
            for rank in ranks:
                rank.reader.send(COUNTED)
            stopped = _wait_exit(ranks, mpiexec_proc, job, start)
            break
        if any(r.error for r in ranks) or _gone(ranks, mpiexec_proc):
            time.sleep(0.05)  # the others' errors, if any, arrive; then the job ends
            for rank in ranks:
                if rank.reader is not None:
                    for kind, body in rank.reader.frames():
                        if kind == EMIT:
                            rank.frames.append(body)
                        elif kind == ERROR:
                            rank.error = json.loads(body)
            break
        if sum(len(f) for r in ranks for f in r.frames) > EMIT_LIMIT:
            stopped = "too much"
            break
        if now - start > job["timeout"]:
            stopped = "timeout"
            break
        if now - last_sample >= SAMPLE_S:
            last_sample = now
            if seen is not None:
                seen.sample()
            for rank in ranks:
                if rank.pid and rank.ready and not rank.done:
                    rank.sampled = max(rank.sampled, _status_bytes(rank.pid, "VmRSS"))
            if job.get("idle_timeout") and _idled(idle, _job_pids(ranks, mpiexec_proc), job["idle_timeout"]):
                stopped = "idle"
                break
        _wait_for_frames(ranks, listener)
    _stop(ranks, mpiexec_proc)
    if listener is not None:
        listener.close()
    return _result(ranks, marks, seen, wire_why, plan, stopped, time.monotonic() - start, job)


def _start_mpi(job: dict):
    import secrets

    from course import mpi

    address = f"k2c-ranks-{secrets.token_hex(16)}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + address)
    listener.listen(job["n"])
    listener.setblocking(False)
    env = dict(os.environ)
    # Every message over loopback TCP, counted or not: the ranks share no memory, no /dev/shm and no
    # unix socket (MPICH's shared-memory and UCX transports need them), only the network.
    env.update(mpi.TCP_ONLY)
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    command = [mpi.mpiexec(), "-launcher", "fork", "-n", str(job["n"]), sys.executable, "-I", "-c", MPI_BOOT,
               package_root, address, json.dumps(job)]
    proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    return listener, proc


def _accept(listener: socket.socket, ranks: list[_Rank]) -> None:
    while True:
        try:
            sock, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _ = struct.unpack("3i", creds)
        sock.settimeout(10)
        try:
            kind, body = receive(sock)
            rank = int(json.loads(body)["rank"])
        except (OSError, ValueError, KeyError, ConnectionError):
            sock.close()
            continue
        # Only a rank's own boot code, before it is kept apart, runs as the launcher's user.
        wants_audit = bool(json.loads(body).get("audit"))
        taken = ranks[rank].audit_fd is not None if wants_audit else ranks[rank].reader is not None
        if kind != HELLO or uid != os.geteuid() or not 0 <= rank < len(ranks) or taken:
            sock.close()
            continue
        sock.settimeout(None)
        if wants_audit:
            sock.setblocking(False)
            ranks[rank].audit_fd = sock.detach()
        else:
            ranks[rank].pid, ranks[rank].reader = pid, _Reader(sock)


def _wait_for_frames(ranks: list[_Rank], listener) -> None:
    fds = [r.reader.sock for r in ranks if r.reader is not None and not r.reader.closed]
    if listener is not None:
        fds.append(listener)
    if fds:
        select.select(fds, [], [], SAMPLE_S)
    else:
        time.sleep(SAMPLE_S)


def _crossed(seen, n: int) -> list:
    """[bytes in all, [bytes sent by each rank]] that crossed so far (the sockets' owners
    say whose); [None, None] when not counted."""
    if seen is None:
        return [None, None]
    by_uid = seen.bytes_sent_by_uid()
    return [seen.bytes_sent(), [by_uid.get(rank_isolation.uid_of(r), 0) for r in range(n)]]


def _gone(ranks: list[_Rank], mpiexec_proc) -> bool:
    """A rank ended before it was done (or mpiexec did)."""
    if mpiexec_proc is not None and mpiexec_proc.poll() is not None:
        return True
    for rank in ranks:
        if rank.reader is not None and rank.reader.closed and not rank.done:
            return True
        if mpiexec_proc is None and rank.pid and rank.exit is None:
            pid, status = os.waitpid(rank.pid, os.WNOHANG)
            if pid:
                rank.exit = os.waitstatus_to_exitcode(status)
                if not rank.done:
                    return True
    return False


def _wait_exit(ranks, mpiexec_proc, job, start) -> str | None:
    """After the last count: the ranks leave by themselves (their barrier), within the time left."""
    deadline = start + job["timeout"]
    while time.monotonic() < deadline:
        if mpiexec_proc is not None:
            if mpiexec_proc.poll() is not None:
                return None
        elif all(r.exit is not None for r in ranks):
            return None
        else:
            for rank in ranks:
                if rank.exit is None:
                    pid, status = os.waitpid(rank.pid, os.WNOHANG)
                    if pid:
                        rank.exit = os.waitstatus_to_exitcode(status)
        time.sleep(0.005)
    return "timeout"


def _job_pids(ranks, mpiexec_proc) -> list[int]:
    from course.jobs import descendants

    if mpiexec_proc is not None:
        return [mpiexec_proc.pid, *descendants(mpiexec_proc.pid)]
    return [r.pid for r in ranks if r.pid and r.exit is None]


def _idled(samples: list, pids: list[int], seconds: float) -> bool:
    now = time.monotonic()
    if samples and now - samples[-1][0] < 0.5:
        return False
    ticks = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks[pid] = int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    samples.append((now, ticks))
    while len(samples) > 1 and now - samples[1][0] >= seconds:
        samples.pop(0)
    then, before = samples[0]
    if now - then < seconds or not ticks:
        return False
    used = sum(count - before.get(pid, -10**9) for pid, count in ticks.items())
    return used < IDLE_CPU_S * os.sysconf("SC_CLK_TCK")


def _stop(ranks: list[_Rank], mpiexec_proc) -> None:
    from course.jobs import kill_tree

    for rank in ranks:
        rank.read_audit()  # what the hook wrote before the job ended

    if mpiexec_proc is not None:
        kill_tree(mpiexec_proc)
    for rank in ranks:
        if mpiexec_proc is None and rank.pid and rank.exit is None:
            try:
                os.kill(rank.pid, signal.SIGKILL)
            except OSError:
                pass
            rank.exit = os.waitstatus_to_exitcode(os.waitpid(rank.pid, 0)[1])
        if rank.reader is not None:
            rank.reader.sock.close()
        rank.read_audit()
        if rank.audit_fd is not None:
            os.close(rank.audit_fd)
            rank.audit_fd = None


def _result(ranks, marks, seen, wire_why, plan, stopped, duration, job) -> dict:
    import numpy as np

    finished = [r.rank for r in ranks if r.done]
    if stopped in ("timeout", "idle"):
        status = "timeout"
    elif stopped == "too much":
        status = "crashed"
    elif any(r.error and r.error["status"] == "infrastructure" for r in ranks):
        status = "infrastructure"
    elif any(r.error and r.error["status"] == "not_implemented" for r in ranks):
        status = "not_implemented"
    elif any(r.error for r in ranks):
        status = "raised"
    elif len(finished) < len(ranks):
        status = "crashed"
    else:
        status = "ok"
    return {
        "status": status, "stopped": stopped or "", "duration_s": duration, "timeout_s": job["timeout"],
        "idle_s": job.get("idle_timeout") or 0.0, "finished": finished,
        "ranks": [{"frames": [np.frombuffer(f, np.uint8) for f in r.frames], "error": r.error,
                   "exit": r.exit, "peak_bytes": r.peak, "baseline_bytes": r.baseline,
                   "hwm_below_sampled": r.tampered, "audit": np.frombuffer(bytes(r.audit), np.uint8)}
                  for r in ranks],
        "marks": marks,
        "wire": ({"unavailable": wire_why} if seen is None
                 else {"bytes": seen.bytes_sent(), "connections": len(seen.sent)}),
        "kept_apart": plan["why"], "own_users": plan["users"],
    }
