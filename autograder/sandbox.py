"""Run one call into student code in a child process, under limits.

The child gets its own session and process group, a wall-clock deadline, a
CPU-time limit and (on the CPU tier) an address-space limit; a watchdog also
sums the resident memory of the whole group, which catches what a per-process
limit cannot (several processes, or a GPU run where an address-space limit
would break the CUDA driver). When the call ends, for whatever reason, every
process it started is killed, so nothing outlives it.
"""
from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from autograder import codec

PAGE = os.sysconf("SC_PAGE_SIZE")
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 60.0
    memory_mb: int | None = 4096  # per group; None: no limit
    address_space: bool = True  # also set RLIMIT_AS (not on a GPU: CUDA reserves huge ranges)


@dataclass
class Outcome:
    """What came back. ``status`` is one of: ok, not_implemented, raised, exit,
    memory, timeout, crashed, no_result."""
    status: str
    value: object = None
    message: str = ""
    where: list = field(default_factory=list)
    error_type: str = ""
    output: str = ""  # the tail of what the student's code printed
    duration_s: float = 0.0


def _limit_child(limits: Limits):
    def apply():
        cpu = int(limits.timeout_s * max(os.cpu_count() or 1, 1)) + 5
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 5))
        if limits.memory_mb and limits.address_space:
            as_bytes = limits.memory_mb * 2**20
            resource.setrlimit(resource.RLIMIT_AS, (as_bytes, as_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def _group_members(pgid: int) -> list[int]:
    """Processes in the group, and every descendant of its leader (in case one
    of them started a session of its own)."""
    members, parent_of = [], {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid, ppid, group = int(entry), int(stat[1]), int(stat[2])
        parent_of[pid] = ppid
        if group == pgid:
            members.append(pid)
    for pid in parent_of:
        p = parent_of.get(pid)
        while p and p != pgid and p in parent_of:
            p = parent_of[p]
        if p == pgid and pid not in members:
            members.append(pid)
    return members


def _group_rss_mb(pgid: int) -> float:
    total = 0
    for pid in _group_members(pgid):
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * PAGE
        except OSError:
            pass
    return total / 2**20


def kill_group(pgid: int) -> None:
    for pid in _group_members(pgid):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


def _tail(path: str, limit: int = 1500) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - limit))
        text = f.read().decode(errors="replace")
    return ("…" + text) if size > limit else text


def run_call(request: dict, limits: Limits, env: dict[str, str] | None = None) -> Outcome:
    """Run ``request`` (see ``autograder.child``) in a fresh sandboxed child."""
    read_end, write_end = os.pipe()
    child_env = dict(os.environ)
    child_env.update(env or {})
    child_env["K2C_RESULT_FD"] = str(write_end)
    child_env["PYTHONDONTWRITEBYTECODE"] = "1"
    # The child must import the grader's own packages even when they are not installed.
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, child_env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="k2c-sandbox-") as tmp:
        log = os.path.join(tmp, "output.txt")
        start = time.monotonic()
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "autograder.child"],
                stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                pass_fds=(write_end,), env=child_env, cwd=tmp,
                start_new_session=True, preexec_fn=_limit_child(limits),
            )
        os.close(write_end)
        chunks: list[bytes] = []
        reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: os.read(read_end, 1 << 20), b"")),
                                  daemon=True)
        reader.start()

        def feed():
            try:
                proc.stdin.write(codec.encode(request))
                proc.stdin.close()
            except OSError:  # the child died before reading its request
                pass
        threading.Thread(target=feed, daemon=True).start()

        status, over_memory = None, False
        deadline = start + limits.timeout_s
        try:
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    status = "timeout"
                    break
                if limits.memory_mb and _group_rss_mb(proc.pid) > limits.memory_mb:
                    over_memory = True
                    break
                time.sleep(0.05)
        finally:
            kill_group(proc.pid)
            proc.wait()
        reader.join(timeout=2)
        os.close(read_end)
        duration = time.monotonic() - start
        output = _tail(log)

    if status == "timeout":
        return Outcome("timeout", message=f"did not finish within {limits.timeout_s:g} s "
                       "(an infinite loop? a deadlock?) and was stopped", output=output, duration_s=duration)
    if over_memory:
        return Outcome("memory", message=f"used more than {limits.memory_mb} MiB of memory and was stopped",
                       output=output, duration_s=duration)
    data = b"".join(chunks)
    if data:
        try:
            reply = codec.decode(data)
            if not isinstance(reply, dict) or "status" not in reply:
                raise codec.CodecError("malformed reply")
        except codec.CodecError as exc:
            return Outcome("crashed", message=f"the reply from the submission's process was unreadable ({exc})",
                           output=output, duration_s=duration)
        return Outcome(reply["status"], value=reply.get("value"), message=reply.get("message", ""),
                       where=reply.get("where", []), error_type=reply.get("type", ""),
                       output=output, duration_s=duration)
    code = proc.returncode
    if code < 0:
        sig = signal.Signals(-code)
        if sig == signal.SIGXCPU:
            why = "used up its CPU-time limit and was stopped"
        else:
            why = f"crashed with {sig.name}" + (" (a segmentation fault)" if sig == signal.SIGSEGV else "")
        return Outcome("crashed", message=why, output=output, duration_s=duration)
    return Outcome("no_result", message=f"the process exited with status {code} before returning a result "
                   "(does the code call os._exit or exit the interpreter?)", output=output, duration_s=duration)
