"""The sandboxed side of a call into student code: ``python -m autograder.child``.

Reads one request from stdin, runs it, writes one reply to the file descriptor
named in ``K2C_RESULT_FD`` and leaves with ``os._exit`` so that no atexit
handler or stray thread of the student's can keep it alive. Everything the
student prints goes to stdout/stderr, which the grader keeps only as feedback.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import tempfile
import threading
import traceback

from autograder import codec
from autograder.reaper import drop_privileges
from course import refuse


def _load(target: dict, submission: str):
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


def main() -> None:
    drop_privileges(os.environ.pop("K2C_RUN_AS", ""))  # before anything of the student's is read
    result_fd = int(os.environ.pop("K2C_RESULT_FD"))
    request = codec.decode(sys.stdin.buffer.read())
    sys.stdin.close()
    sys.stdin = open(os.devnull)
    if request.get("simulator"):
        # The CUDA simulator runs every CUDA thread of a block as a Python thread:
        # switch between them often (much faster), and give them small stacks, or
        # a few blocks of 256 threads (8 MiB of address space each) would reach
        # the RLIMIT_AS the sandbox sets.
        sys.setswitchinterval(1e-4)
        threading.stack_size(2 * 2**20)
    os.chdir(tempfile.mkdtemp(prefix="k2c-run-"))
    refuse.install_from_env()  # what the lab asks students to build, refused before their code loads
    reply = run(request)
    try:
        payload = codec.encode(reply)
    except codec.CodecError as exc:
        payload = codec.encode({"status": "raised", "type": "TypeError", "message": str(exc), "where": []})
    with os.fdopen(result_fd, "wb") as out:
        out.write(payload)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
