"""The sandboxed side of the calls into student code: ``python -m autograder.sandbox.child``.

One such process serves every call of one sandbox (``autograder.sandbox.Sandbox``).
It imports what the lab's calls need once (``K2C_PRELOAD``: torch, numba), then
for each request the grader writes to its stdin it forks a child that

- becomes the student's user (``autograder.sandbox.reaper.drop_privileges``),
- runs the request in a fresh folder of the scratch space, and
- writes its reply into a pipe, then leaves with ``os._exit``, so that no atexit
  handler or stray thread of the student's can keep it alive.

When that child ends, the server kills every process it left (orphans come back
to the server, a child subreaper), empties the scratch space, and only then
sends the grader the child's exit status and its reply. It passes the reply
on as bytes, unread: only the grader decodes it (``autograder.sandbox.codec``).

The student's processes cannot reach the server: under bubblewrap it stays
root (with only CAP_SETUID, CAP_SETGID and CAP_KILL, to make the children and
kill what they leave) while they run as ``nobody``, so they can neither signal
nor trace it; they never hold its pipes to the grader; and it imports nothing
from a folder they can write (it runs with ``python -P -s``). Everything the
student prints goes to stdout/stderr, which the grader keeps only as feedback.
"""
from __future__ import annotations

import importlib
import json
import importlib.util
import os
import select
import struct
import sys
import tempfile
import threading
import traceback

from autograder.sandbox import audit, codec
from autograder.sandbox.reaper import PR_SET_CHILD_SUBREAPER, _prctl, drop_privileges, kill_and_reap_all
from course import cuda_sim, refuse

# grader -> server: a length, then a request (codec); server -> grader: the child's
# exit code (negative: the signal that ended it), the lengths of its reply and of its
# flag records (autograder.sandbox.audit), then the reply, then the records. While the
# call runs, its flag records go to the grader as they come, each piece as a REPLY whose
# code is FLAGS_SO_FAR, with no reply: a call the grader stops for time or memory is
# not answered, and its flags must still reach the instructor.
REQUEST = struct.Struct("<Q")
REPLY = struct.Struct("<qQQ")
FLAGS_SO_FAR = -(2**63)  # no exit code: a piece of the running call's flag records
REPLY_LIMIT = 2**30  # bytes of a reply kept; a longer one arrives cut, and the grader finds it unreadable
FLAGS_LIMIT = 2**18  # bytes of flag records passed on per call
READS_ENV = "K2C_AUDIT_READS"  # [needed paths, hidden paths] (autograder.sandbox.isolation), as JSON
# What a call may read besides its own folder, for the flags (the bubblewrap layer shows no more).
SYSTEM_READS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/sys", "/dev", "/proc", "/run")


def _load(target: dict, submission: str):
    if target["kind"] == "import":  # does the module import at all (Submission.import_failure)
        importlib.import_module(target["module"])
        return lambda: None
    if target["kind"] == "harness":
        spec = importlib.util.spec_from_file_location("k2c_harness", target["path"])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target["module"])
    try:
        return getattr(module, target["func"])
    except AttributeError:
        where = os.path.basename(getattr(module, "__file__", "") or target.get("module", "?"))
        raise AttributeError(f"{where} has no function named {target['func']!r}") from None


def _where(tb, submission: str) -> list[str]:
    """The frames of the student's own files: where in *their* code it went wrong."""
    frames = [f for f in traceback.extract_tb(tb) if f.filename.startswith(submission)]
    return [f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}: {(f.line or '').strip()}"
            for f in frames[-3:]]


def run(request: dict) -> dict:
    submission = os.path.realpath(request["submission"])
    sys.path.insert(0, submission)
    try:
        fn = _load(request["target"], submission)
        value = fn(*request.get("args", []), **request.get("kwargs", {}))
        return {"status": "ok", "value": value}
    except NotImplementedError as exc:
        return {"status": "not_implemented", "message": str(exc)}
    except SystemExit as exc:
        return {"status": "exit", "message": f"called sys.exit({exc.code!r})"}
    except MemoryError:
        return {"status": "memory", "message": "ran out of memory (MemoryError)"}
    except BaseException as exc:  # noqa: BLE001 - anything the student raises is reported
        if getattr(exc, "status", None) == "timeout":  # a job of several processes that hung (course.mpi)
            return {"status": "timeout", "message": str(exc)}
        return {"status": "raised", "type": type(exc).__name__, "message": str(exc),
                "where": _where(exc.__traceback__, submission)}


def _launch(request: dict, reply_fd: int, reads: tuple[list[str], list[str]]) -> None:
    """A rank job's launcher (``autograder.sandbox.ranks``): course code only, which imports
    nothing of the student's and keeps the server's privileges to give each rank a user of
    its own; the ranks it starts run the student's code. Never returns."""
    from autograder.sandbox import ranks

    try:
        os.chdir("/")
        allowed, denied = reads
        job = dict(request["target"]["job"], submission=request["submission"],
                   reads=[[*SYSTEM_READS, *allowed, "/tmp"], list(denied)])
        reply = {"status": "ok", "value": ranks.launch(job)}
    except BaseException as exc:  # noqa: BLE001 - the launcher's own failure: the grader's problem, said so
        reply = {"status": "crashed", "message": f"the rank launcher failed: {type(exc).__name__}: {exc}"}
    with os.fdopen(reply_fd, "wb") as out:
        out.write(codec.encode(reply))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _call(request: dict, reply_fd: int, flags_fd: int, server_fds: tuple[int, ...], run_as: str,
          reads: tuple[list[str], list[str]]) -> None:
    """The forked child: one call, as the student's user. Never returns."""
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)  # the server's stdin carries the grader's next requests
        for fd in server_fds:
            os.close(fd)  # its pipe to the grader: the student's code must never hold it
        sys.stdin = open(os.devnull)
        if request.get("target", {}).get("kind") == "ranks":
            os.close(flags_fd)
            _launch(request, reply_fd, reads)
        drop_privileges(run_as)  # before anything of the student's is read
        if request.get("simulator"):
            # The CUDA simulator runs every CUDA thread of a block as a Python thread:
            # schedule them with barriers that wake them (course.cuda_sim; once the
            # server has imported numba.cuda), and give them small stacks, or a few
            # blocks of 256 threads (8 MiB of address space each) would reach the
            # RLIMIT_AS the sandbox sets.
            if "numba.cuda" in sys.modules:
                cuda_sim.install()
            else:
                sys.setswitchinterval(1e-4)
            threading.stack_size(2 * 2**20)
        tempfile.tempdir = None  # found again, as the student's user: the server may have cached another
        os.chdir(tempfile.mkdtemp(prefix="k2c-run-"))
        allowed, denied = reads
        target = request.get("target", {})
        here = [tempfile.gettempdir(), os.environ.get("HOME", ""), os.getcwd(),
                os.path.dirname(target.get("path", "")) if target.get("kind") == "harness" else ""]
        audit.install(flags_fd, request["submission"], [*SYSTEM_READS, *allowed, *here], denied, _call.__code__)
        reply = run(request)
        audit.end()
        try:
            payload = codec.encode(reply)
        except codec.CodecError as exc:
            payload = codec.encode({"status": "raised", "type": "TypeError", "message": str(exc), "where": []})
        with os.fdopen(reply_fd, "wb") as out:
            out.write(payload)
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001 - the grader's own failure: shown in the call's output
        traceback.print_exc()
        sys.stderr.flush()
    finally:
        os._exit(0)


def _collect(pid: int, reply_fd: int, flags_fd: int, pass_flags) -> tuple[int, bytes]:
    """Read the child's reply while it runs, and hand its flag records to ``pass_flags`` as they
    come (at most ``FLAGS_LIMIT`` bytes); (its exit code, the reply) once it has ended. A process
    it left may hold the pipes open, so the end is the child's exit, not EOF."""
    kept = {reply_fd: bytearray(), flags_fd: bytearray()}
    room = {reply_fd: REPLY_LIMIT, flags_fd: FLAGS_LIMIT}
    status = None
    while True:
        if status is None:
            done, wait_status = os.waitpid(pid, os.WNOHANG)
            if done:
                status = os.waitstatus_to_exitcode(wait_status)
                for fd in kept:
                    os.set_blocking(fd, False)
        got = False
        for fd in select.select(list(kept), [], [], 0.05 if status is None else 0)[0]:
            try:
                data = os.read(fd, 1 << 20)
            except BlockingIOError:
                data = b""
            if data:
                got = True
                data = data[:max(room[fd], 0)]
                room[fd] -= len(data)
                if fd == flags_fd and data:
                    pass_flags(data)
                elif fd == reply_fd:
                    kept[fd] += data
        if status is not None and not got:
            for fd in kept:
                os.close(fd)
            return status, bytes(kept[reply_fd])


def _empty(folder: str) -> None:
    """Remove everything in ``folder`` (as the user that wrote it)."""
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                os.chmod(path, 0o700)  # a folder its owner made unreadable
                _empty(path)
                os.rmdir(path)
            else:
                os.unlink(path)
        except OSError:
            pass


def _empty_scratch(run_as: str, folders: list[str]) -> None:
    """The next call starts with empty scratch folders, like the first."""
    pid = os.fork()
    if pid == 0:
        try:
            drop_privileges(run_as)
            for folder in folders:
                if os.path.isdir(folder):
                    _empty(folder)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def _read_exactly(fd: int, n: int) -> bytes | None:
    data = bytearray(n)  # filled in place: a request of arrays can be tens of MB, read in pipe-sized pieces
    view, got = memoryview(data), 0
    while got < n:
        read = os.readv(fd, [view[got:]])
        if not read:
            return None
        got += read
    return bytes(data)


def serve() -> None:
    result_fd = int(os.environ.pop("K2C_RESULT_FD"))
    run_as = os.environ.pop("K2C_RUN_AS", "")
    scratch = [f for f in os.environ.pop("K2C_SCRATCH", "").split(os.pathsep) if f]
    _prctl(PR_SET_CHILD_SUBREAPER, 1)  # what a call leaves behind comes back here to be killed
    refuse.install_from_env()  # what the lab asks students to build, refused before anything loads
    for name in filter(None, os.environ.pop("K2C_PRELOAD", "").split(",")):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a call that needs it meets the same error itself
            pass
    if os.environ.get("K2C_TIER") == "cpu" and os.environ.get("NUMBA_ENABLE_CUDASIM") == "0" \
            and "numba.cuda" in sys.modules:
        # The CPU tier's compiling server (Submission.compiling): its calls compile kernels for a
        # real GPU, and each would load the compiler again. No device is touched: there is none.
        from course import gpu_compile

        try:
            gpu_compile.warm_up()
        except Exception:  # noqa: BLE001 - as above: the calls meet the error themselves
            pass
    os.chdir("/")
    # What the flags count as the call's to read (autograder.sandbox.audit): found by the grader,
    # outside the sandbox, where the checkout's and the grader's other files can be seen to hide.
    reads = tuple(json.loads(os.environ.pop(READS_ENV, "[[], []]")))
    out = os.fdopen(result_fd, "wb", buffering=0)
    out.write(REPLY.pack(0, 0, 0))  # ready
    while True:
        header = _read_exactly(0, REQUEST.size)
        if header is None:  # the grader closed the sandbox
            os._exit(0)
        request = codec.decode(_read_exactly(0, REQUEST.unpack(header)[0]) or b"")
        reply_r, reply_w = os.pipe()
        flags_r, flags_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(reply_r)
            os.close(flags_r)
            _call(request, reply_w, flags_w, (result_fd,), run_as, reads)
        os.close(reply_w)
        os.close(flags_w)
        code, reply = _collect(pid, reply_r, flags_r,
                               lambda data: out.write(REPLY.pack(FLAGS_SO_FAR, 0, len(data)) + data))
        kill_and_reap_all()
        _empty_scratch(run_as, scratch)
        out.write(REPLY.pack(code, len(reply), 0) + reply)


if __name__ == "__main__":
    serve()
